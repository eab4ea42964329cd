"""Per-request sampling state and its batched, on-device form for one step.

`SamplingMetadata.from_states` turns R `SamplingState`s into `[R]` tensors once per
step, plus flags (`all_greedy`, `no_penalties`, `no_top_k`, ...) that let the sampler
skip whole stages: a batch of greedy requests without penalties is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowengine.sampling_params import SamplingParams

# Large prime mixing a request's seed with the index of the token being sampled, so
# that (seed, i) pairs of nearby seeds do not collide for small i.
_SEED_STRIDE = 1_000_003
_SEED_MODULUS = 2**63
# The largest temperature the float32 sampling tensors hold: a larger (finite) one
# would become inf there, and logits / inf = 0 ties every token, so top-k, top-p and
# min-p would keep the whole vocabulary. The tempered distribution is uniform over
# what the filters keep at either value.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max


def step_seed(seed: int, output_index: int) -> int:
    """Seed for sampling output token number `output_index` of a request seeded `seed`.

    A pure function of the request's own (seed, position): the token does not depend
    on which requests share the batch, on the row, or on a restart that recomputes it.
    Result in [0, 2**63).
    """
    return (seed * _SEED_STRIDE + output_index) % _SEED_MODULUS


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs from one request at this step.

    prompt_token_ids feed the repetition penalty; output_token_ids (generated so far,
    not including the token being sampled) feed all penalties, min_tokens and the
    per-token seed; eos_token_id is masked while min_tokens is not reached.
    """

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None = None


def _bad_word_bans(words: list[list[int]], output_token_ids: list[int], vocab_size: int) -> list[int]:
    """Ids that would complete a bad word now: a one-token word's id always; a longer
    word's last id when the generated tokens end with the rest of it (vLLM's rule:
    only generated tokens count, never the prompt)."""
    banned = set()
    for word in words:
        prefix = word[:-1]
        if not prefix or (
            len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix
        ):
            banned.add(word[-1])
    return sorted(t for t in banned if t < vocab_size)


def static_row(params: SamplingParams, vocab_size: int) -> tuple:
    """A request's per-row sampling values that do not change between its steps:
    (vocab_size, is_greedy, temperature, top_k, top_p, min_p, repetition, frequency and
    presence penalties, number of logprobs, whether the row needs per-row edits), with
    the neutral values of `SamplingMetadata` for greedy rows."""
    p = params
    greedy = p.is_greedy
    special = bool(p.bad_words_token_ids or p.allowed_token_ids is not None or p.logit_bias
                   or (not greedy and p.seed is not None) or p.min_tokens > 0)
    return (vocab_size, greedy, 1.0 if greedy else min(p.temperature, _MAX_TEMPERATURE),
            vocab_size if greedy or p.top_k <= 0 else min(p.top_k, vocab_size),
            1.0 if greedy else p.top_p, 0.0 if greedy else p.min_p, p.repetition_penalty,
            p.frequency_penalty, p.presence_penalty,
            vocab_size if p.logprobs == -1 else p.logprobs, special)


def _static_row(state: SamplingState, vocab_size: int) -> tuple:
    """static_row of the state's params, kept on the state when it has a
    `sampling_row` slot (the executor's RequestState lives as long as its request, so
    the row is computed once, not every step)."""
    row = getattr(state, "sampling_row", None)
    if row is None or row[0] != vocab_size:
        row = static_row(state.sampling_params, vocab_size)
        if hasattr(state, "sampling_row"):
            # Interned: requests of equal params share one tuple, so a batch's rows
            # compare by identity (from_states' `count`). Bounded: a full table starts
            # over (rows interned before stay valid, only unshared).
            if len(_INTERNED_ROWS) >= _MAX_INTERNED_ROWS:
                _INTERNED_ROWS.clear()
            row = state.sampling_row = _INTERNED_ROWS.setdefault(row, row)
    return row


_INTERNED_ROWS: dict[tuple, tuple] = {}
_MAX_INTERNED_ROWS = 4096


def _static_rows(states: list[SamplingState], vocab_size: int) -> tuple[list[tuple], bool]:
    """(static_row of every state in order, whether they are all one row): the rows
    cached on the states (the executor's RequestState) read in one pass when every one
    is there and of this vocabulary, else state by state (`_static_row`)."""
    try:
        rows = [s.sampling_row for s in states]
    except AttributeError:  # SamplingStates: no cache
        rows = [_static_row(s, vocab_size) for s in states]
    else:
        first = rows[0] if rows else None
        if first is not None and first[0] == vocab_size and rows.count(first) == len(rows):
            return rows, True  # one row for all: checked once
        if None in rows or next(zip(*rows, strict=False), ()).count(vocab_size) != len(rows):
            rows = [_static_row(s, vocab_size) for s in states]
    return rows, bool(rows) and rows.count(rows[0]) == len(rows)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA copied from pinned host memory, so
    the copy is asynchronous (no host sync)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return to_device([r + [pad] * (width - len(r)) for r in rows], torch.int64, device)


@dataclass(slots=True)
class SamplingMetadata:
    """Sampling parameters of a batch of R requests, as device tensors.

    A tensor is None when no row needs its stage (the matching `no_*`/`all_*` flag is
    then True). Rows that do not use a stage hold its neutral value (top_k = V,
    top_p = 1, min_p = 0, penalties 1/0/0, temperature 1 for greedy rows).

    Attributes:
        temperature: [R] float32, None when every sampled row has temperature 1.
        is_greedy: [R] bool, None when the batch is all greedy or all random.
        top_k: [R] int64 in [1, V]; top_p: [R] float32 in (0, 1]; min_p: [R] float32.
        prompt_token_ids / output_token_ids: [R, P] / [R, O] int64 padded with V
            (an id one past the vocabulary, dropped after the scatter).
        repetition_penalties / frequency_penalties / presence_penalties: [R] float32,
            each None when no row uses it; output_token_ids is None when none is used.
        min_tokens_rows / min_tokens_token_ids: [M] int64 pairs (row, id) to set to
            -inf because the row has fewer than min_tokens outputs.
        bad_words_rows / bad_words_token_ids: [B] int64 pairs (row, id) to set to -inf
            because the id would complete one of the row's bad words.
        allowed_rows: [A] int64 rows with allowed_token_ids; allowed_pair_rows /
            allowed_pair_ids: [P] int64 (row, id) pairs of the ids those rows allow.
        logit_bias_rows / logit_bias_token_ids / logit_bias_values: [K] int64, int64,
            float32: add value to logits[row, id].
        seeded_rows / row_seeds: rows with a per-request seed and the seed of this
            step's draw (`step_seed`).
        num_logprobs: per row, the N of `logprobs=N` (V for -1) or None; logprob_rows: [L] int64
            rows with logprobs asked, max_num_logprobs: max N over them (None if L = 0).
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None
    is_greedy: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    min_tokens_rows: torch.Tensor | None
    min_tokens_token_ids: torch.Tensor | None
    bad_words_rows: torch.Tensor | None
    bad_words_token_ids: torch.Tensor | None
    allowed_rows: torch.Tensor | None
    allowed_pair_rows: torch.Tensor | None
    allowed_pair_ids: torch.Tensor | None
    logit_bias_rows: torch.Tensor | None
    logit_bias_token_ids: torch.Tensor | None
    logit_bias_values: torch.Tensor | None
    seeded_rows: list[int]
    row_seeds: list[int]
    num_logprobs: list[int | None]
    logprob_rows: torch.Tensor | None
    max_num_logprobs: int | None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_min_tokens(self) -> bool:
        return self.min_tokens_rows is None

    @property
    def no_logits_edits(self) -> bool:
        """True when no row uses min_tokens, bad_words, allowed_token_ids or logit_bias."""
        return (self.min_tokens_rows is None and self.bad_words_rows is None
                and self.allowed_rows is None and self.logit_bias_rows is None)

    @classmethod
    def from_states(
        cls, states: list[SamplingState], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        """Batch `states` (one per logits row, in row order) for a `[R, vocab_size]` step.

        A state is a `SamplingState` or any object with its four attributes (the
        executor passes its `RequestState`s, which also keep their `static_row`).

        Stop/EOS ids outside [0, vocab_size) are ignored by min_tokens masking: the
        model cannot produce them anyway; so are such ids in logit_bias,
        allowed_token_ids and bad words (the input processor refuses them for the
        engine's vocabulary, which the logits may pad).
        """
        device = torch.device(device)
        num_reqs = len(states)
        v = vocab_size
        rows, uniform = _static_rows(states, v)
        if uniform:
            # Every row alike (the usual batch; interned rows compare by identity).
            columns = [[x] * num_reqs for x in rows[0]]
        else:
            columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[]] * 11
        (_, greedy, temps, top_ks, top_ps, min_ps, reps, freqs, press, num_logprobs,
         special) = columns
        all_greedy = all(greedy)
        all_random = not any(greedy)

        mt_rows: list[int] = []
        mt_ids: list[int] = []
        seeded_rows: list[int] = []
        row_seeds: list[int] = []
        bw_rows: list[int] = []
        bw_ids: list[int] = []
        al_rows: list[int] = []
        al_pair_rows: list[int] = []
        al_pair_ids: list[int] = []
        lb_rows: list[int] = []
        lb_ids: list[int] = []
        lb_vals: list[float] = []
        # Only the rows whose params use per-row edits (bad words, allowed ids, logit
        # bias, a seed, min_tokens) are visited again.
        for row in (i for i, x in enumerate(special) if x) if any(special) else ():
            s = states[row]
            p = s.sampling_params
            if p.bad_words_token_ids:
                ids = _bad_word_bans(p.bad_words_token_ids, s.output_token_ids, v)
                bw_rows.extend([row] * len(ids))
                bw_ids.extend(ids)
            if p.allowed_token_ids is not None:
                ids = sorted({t for t in p.allowed_token_ids if t < v})
                al_rows.append(row)
                al_pair_rows.extend([row] * len(ids))
                al_pair_ids.extend(ids)
            if p.logit_bias:
                for t, bias in p.logit_bias.items():
                    if t < v:
                        lb_rows.append(row)
                        lb_ids.append(t)
                        lb_vals.append(bias)
            if not greedy[row] and p.seed is not None:
                seeded_rows.append(row)
                row_seeds.append(step_seed(p.seed, len(s.output_token_ids)))
            if len(s.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if s.eos_token_id is not None and not p.ignore_eos:
                    banned.add(s.eos_token_id)
                ids = sorted(t for t in banned if 0 <= t < v)
                mt_rows.extend([row] * len(ids))
                mt_ids.extend(ids)

        f32 = torch.float32
        sampled = not all_greedy
        # Whether any row leaves a stage's neutral value, by C-level counts (list.count
        # compares with ==, as `!=` would): static_row keeps top_k in [1, V], top_p in
        # (0, 1] and min_p in [0, 1] (SamplingParams validates them), so "k < V",
        # "p < 1" and "m > 0" are "not the neutral value".
        use_temp = sampled and temps.count(1.0) != num_reqs
        use_top_k = sampled and top_ks.count(v) != num_reqs
        use_top_p = sampled and top_ps.count(1.0) != num_reqs
        use_min_p = sampled and min_ps.count(0.0) != num_reqs
        use_rep = reps.count(1.0) != num_reqs
        use_freq = freqs.count(0.0) != num_reqs
        use_pres = press.count(0.0) != num_reqs
        use_penalties = use_rep or use_freq or use_pres

        prompt_ids = output_ids = None
        if use_penalties:
            # Only the rows that use the repetition penalty need their prompt.
            prompt_rows = [
                s.prompt_token_ids if r != 1.0 else [] for s, r in zip(states, reps, strict=True)
            ]
            prompt_ids = _padded(prompt_rows, v, device) if use_rep else None
            output_ids = _padded([s.output_token_ids for s in states], v, device)

        lp_rows = ([] if num_logprobs.count(None) == num_reqs else
                   [i for i, n in enumerate(num_logprobs) if n is not None])
        return cls(
            num_reqs=num_reqs,
            vocab_size=v,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=to_device(temps, f32, device) if use_temp else None,
            is_greedy=None if all_greedy or all_random else to_device(greedy, torch.bool, device),
            top_k=to_device(top_ks, torch.int64, device) if use_top_k else None,
            top_p=to_device(top_ps, f32, device) if use_top_p else None,
            min_p=to_device(min_ps, f32, device) if use_min_p else None,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            repetition_penalties=to_device(reps, f32, device) if use_rep else None,
            frequency_penalties=to_device(freqs, f32, device) if use_freq else None,
            presence_penalties=to_device(press, f32, device) if use_pres else None,
            min_tokens_rows=to_device(mt_rows, torch.int64, device) if mt_rows else None,
            min_tokens_token_ids=to_device(mt_ids, torch.int64, device) if mt_rows else None,
            bad_words_rows=to_device(bw_rows, torch.int64, device) if bw_rows else None,
            bad_words_token_ids=to_device(bw_ids, torch.int64, device) if bw_rows else None,
            allowed_rows=to_device(al_rows, torch.int64, device) if al_rows else None,
            allowed_pair_rows=to_device(al_pair_rows, torch.int64, device) if al_rows else None,
            allowed_pair_ids=to_device(al_pair_ids, torch.int64, device) if al_rows else None,
            logit_bias_rows=to_device(lb_rows, torch.int64, device) if lb_rows else None,
            logit_bias_token_ids=to_device(lb_ids, torch.int64, device) if lb_rows else None,
            logit_bias_values=to_device(lb_vals, f32, device) if lb_rows else None,
            seeded_rows=seeded_rows,
            row_seeds=row_seeds,
            num_logprobs=num_logprobs,
            logprob_rows=to_device(lp_rows, torch.int64, device) if lp_rows else None,
            max_num_logprobs=max(num_logprobs[i] for i in lp_rows) if lp_rows else None,
        )
