"""Batched sampler: `[R, V]` logits -> `[R]` token ids (+ logprobs), on the device.

Pipeline, in vLLM's order:

1. logprobs, if any row asks, from the raw logits (vLLM v1's default "raw_logprobs");
2. allowed_token_ids and bad_words masks, min_tokens masking of EOS / stop ids,
   logit_bias; then repetition, frequency, presence penalties;
3. greedy rows take the argmax;
4. other rows: temperature, top-k, top-p, min-p, then one draw per row by the
   exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. per token picks token i
   with probability probs[i] / sum(probs) (the Gumbel-max trick in exponential form),
   with no normalisation, no cumsum and no host sync.

On CUDA, for a batch without top-k, top-p or min-p, step 4 (and the greedy rows' argmax)
is one Triton kernel (`kernels/sampling.py`: argmax(l / T - log q), the same race
without the softmax); the grammar bitmask before it is one kernel too. On the CPU,
step 4 with its filters is one C call over the rows (`flowengine._cpu_ops.sample_rows`,
Sampler._race_on_host). Both draw q from the counter-based generator below with a key
per row, so a seeded row takes the same token on every path.
FLOWENGINE_FUSED_SAMPLING=0 turns both off (the torch ops of `_sample_random`).

Seeded rows draw q from a counter-based generator (`seeded_exponential`): a pure
function of (`step_seed(seed, num_output_tokens)`, token id), computed for all seeded
rows of a step by a few element-wise tensor ops, so their tokens depend on nothing else
in the batch, are the same on the CPU and on CUDA, and are reproduced after a restart
that recomputes the request. Unseeded rows share one batch-wide `torch.Generator`.
"""

from __future__ import annotations

import os

import torch

from flowengine.sample.filters import apply_min_p, apply_top_k_top_p
from flowengine.sample.metadata import SamplingMetadata, SamplingState, to_device
from flowengine.sample.output import LogprobsTensors, SamplerOutput
from flowengine.sample.penalties import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    ban_tokens,
)


class Sampler:
    """Stateless apart from its random generators; no asyncio, no processes.

    Args:
        seed: seed of the batch-wide generator used by unseeded rows; None seeds it
            from the operating system's entropy.

    Generators are created on first use for the device of the logits (CPU or a
    CUDA device), so one sampler serves whichever device the executor runs on.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _batch_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row of `logits` [R, V] for `states` (one per row)."""
        metadata = SamplingMetadata.from_states(states, logits.shape[1], logits.device)
        return self.sample(logits, metadata)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        logits: [R, V] float32 (other float dtypes are upcast) on any device, with
        `metadata` built for the same device; never modified. Raises ValueError if R
        or V disagree with `metadata`.
        """
        if logits.dim() != 2 or tuple(logits.shape) != (metadata.num_reqs, metadata.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the sampling metadata "
                f"([{metadata.num_reqs}, {metadata.vocab_size}]); build it for this batch"
            )
        logits = logits.to(torch.float32)
        raw_logprobs = None
        if metadata.logprob_rows is not None:
            raw_logprobs = torch.log_softmax(logits[metadata.logprob_rows], dim=-1)

        owned = False  # whether `logits` is our own copy that may be modified in place
        m = metadata
        if not m.no_logits_edits or not m.no_penalties:
            logits, owned = logits.clone(), True
            if m.allowed_rows is not None:
                apply_allowed_token_ids(logits, m.allowed_rows, m.allowed_pair_rows,
                                        m.allowed_pair_ids)
            if m.bad_words_rows is not None:
                ban_tokens(logits, m.bad_words_rows, m.bad_words_token_ids)
            if not m.no_min_tokens:
                apply_min_tokens(logits, m.min_tokens_rows, m.min_tokens_token_ids)
            if m.logit_bias_rows is not None:
                apply_logit_bias(logits, m.logit_bias_rows, m.logit_bias_token_ids,
                                 m.logit_bias_values)
            if not metadata.no_penalties:
                apply_penalties(
                    logits,
                    metadata.prompt_token_ids,
                    metadata.output_token_ids,
                    metadata.repetition_penalties,
                    metadata.frequency_penalties,
                    metadata.presence_penalties,
                )

        if metadata.all_greedy:
            sampled = (self._argmax_on_host(logits) if self._can_race_on_host(logits)
                       else logits.argmax(dim=-1))
        elif self._can_fuse(logits, metadata):
            sampled = self._race_fused(logits, metadata)
        elif self._can_race_on_host(logits):
            sampled = self._race_on_host(logits, metadata)
        else:
            greedy = None if metadata.all_random else logits.argmax(dim=-1)
            random = self._sample_random(logits if owned else logits.clone(), metadata)
            sampled = random if greedy is None else torch.where(metadata.is_greedy, greedy, random)

        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = LogprobsTensors.compute(
                raw_logprobs, sampled[metadata.logprob_rows], metadata.max_num_logprobs or 0
            )
        return SamplerOutput(sampled, metadata.num_logprobs, logprobs_tensors)

    @staticmethod
    def _can_fuse(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
        """Whether the race runs as one kernel (`kernels/sampling.py`): on CUDA, for a
        batch without top-k, top-p or min-p, unless FLOWENGINE_FUSED_SAMPLING=0."""
        return (logits.device.type == "cuda" and FUSED_SAMPLING
                and metadata.top_k is None and metadata.top_p is None
                and metadata.min_p is None and fused_kernels() is not None)

    def _race_fused(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The exponential race of `_sample_random` (greedy rows too) in one kernel:
        argmax(l / T - log q) = argmax(softmax(l / T) / q) for q ~ Exp(1), q drawn from
        the same counter-based U as `seeded_exponential` with each row's key: its step
        seed, or for unseeded rows a value from the batch generator (one device op).
        Each op costs ~10-15 us of host time on the H200's host (session 32): the
        unfused path is ~8 ops plus ~15 for seeded rows."""
        inv_temperature = (None if metadata.temperature is None
                           else metadata.temperature.reciprocal())
        return fused_kernels().exponential_race(logits, self._race_keys(metadata, logits.device),
                                                inv_temperature, metadata.is_greedy)

    def _race_keys(self, metadata: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """[R] int64 keys of the counter-based race: a seeded row's step seed, for the
        others a value from the batch generator (one op for all of them)."""
        seeded = metadata.seeded_rows
        if len(seeded) == metadata.num_reqs:
            return to_device(metadata.row_seeds, torch.int64, device)
        keys = torch.randint(0, 2**62, (metadata.num_reqs,), dtype=torch.int64,
                             device=device, generator=self._batch_generator(device))
        if seeded:
            keys[to_device(seeded, torch.int64, device)] = to_device(
                metadata.row_seeds, torch.int64, device)
        return keys

    @staticmethod
    def _can_race_on_host(logits: torch.Tensor) -> bool:
        """Whether the CPU's C sampler (`flowengine._cpu_ops.sample_rows`) takes the
        batch: float32 CPU logits with unit stride over the vocabulary, the extension
        built, unless FLOWENGINE_FUSED_SAMPLING=0."""
        return (logits.device.type == "cpu" and FUSED_SAMPLING and logits.stride(1) == 1
                and logits.stride(0) >= logits.shape[1] and cpu_ops() is not None)

    @staticmethod
    def _argmax_on_host(logits: torch.Tensor) -> torch.Tensor:
        """[R] int64: each row's first maximum (torch.argmax's rule), one C call over
        the rows on the executor's threads (greedy = 1: every row greedy)."""
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        if not logits.shape[0]:
            return out
        cpu_ops().sample_rows(logits.data_ptr(), logits.shape[0], logits.shape[1],
                              logits.stride(0), 0, 0, 0, 0, 0, 1, out.data_ptr(),
                              torch.get_num_threads())
        return out

    def _race_on_host(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the race of `_sample_random` (greedy
        rows their argmax) in one C call over the rows, on the executor's threads: the
        same tokens as the torch ops for seeded rows (up to float rounding at a
        filter's threshold or between two near-equal scores), the same distribution
        for the others. The torch ops woke torch's intra-op threads once per op, ~2 ms
        per step at batch 1 on the 2-core CPU (docs/benchmarks.md, session 33)."""
        m = metadata
        if not m.num_reqs:
            return torch.empty(0, dtype=torch.int64)
        keys = self._race_keys(m, logits.device)
        inv_t = None if m.temperature is None else m.temperature.reciprocal()
        greedy = None if m.is_greedy is None else m.is_greedy.to(torch.uint8)
        out = torch.empty(m.num_reqs, dtype=torch.int64)

        # Kept alive until the call returns (their pointers are read there).
        arrays = [None if a is None else a.contiguous()
                  for a in (inv_t, m.top_k, m.top_p, m.min_p, keys, greedy)]

        def ptr(i: int) -> int:
            return 0 if arrays[i] is None else arrays[i].data_ptr()

        cpu_ops().sample_rows(logits.data_ptr(), m.num_reqs, logits.shape[1],
                              logits.stride(0), ptr(0), ptr(1), ptr(2), ptr(3), ptr(4),
                              ptr(5), out.data_ptr(),
                              torch.get_num_threads())
        return out

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race. `logits` [R, V]
        float32 is ours to modify. Returns [R] int64."""
        if metadata.temperature is not None:
            logits.div_(metadata.temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        if metadata.min_p is not None:
            apply_min_p(probs, metadata.min_p)
        device = probs.device
        seeded = metadata.seeded_rows
        if len(seeded) == metadata.num_reqs:  # every row seeded, rows 0..R-1 in order
            q = seeded_exponential(metadata.row_seeds, probs.shape[1], device)
        else:
            q = _exponential_(torch.empty_like(probs), self._batch_generator(device))
            if seeded:
                q[to_device(seeded, torch.int64, device)] = seeded_exponential(
                    metadata.row_seeds, probs.shape[1], device)
        # Exp(1) can round to 0; a tiny floor keeps 0-probability tokens at 0 instead of NaN.
        # U = 0 gives q = inf: the ceiling keeps such a token drawable when it is the only
        # one the filters kept (else every score is 0 and argmax answers token 0).
        finfo = torch.finfo(torch.float32)
        q.clamp_(min=finfo.tiny, max=finfo.max)
        return probs.div_(q).argmax(dim=-1)


# The race and the grammar bitmask as Triton kernels on CUDA where they apply
# (Sampler._can_fuse, grammar_bitmask._apply_on_device); FLOWENGINE_FUSED_SAMPLING=0
# turns them off. On by default since session 33: on an H100, batch 128 with async
# scheduling, 8.6% more output tok/s unconstrained and 7-8% more with a JSON schema than
# the torch ops (docs/benchmarks.md, "Session 33"); tests/kernels/test_kernel_sampling.py
# and tests/sample passed on that H100.
FUSED_SAMPLING = os.environ.get("FLOWENGINE_FUSED_SAMPLING", "1") != "0"


def cpu_ops():
    """The C extension flowengine._cpu_ops (built by pip install), else None."""
    try:
        from flowengine import _cpu_ops
    except ImportError:  # pragma: no cover - a source tree without the build
        return None
    return _cpu_ops


def fused_kernels():
    """The module flowengine.kernels.sampling where Triton imports, else None (the
    callers gate its use on FUSED_SAMPLING)."""
    try:
        from flowengine.kernels import sampling
    except ImportError:  # pragma: no cover - Triton is a dependency where CUDA is
        return None
    return sampling


# splitmix64's constants (Steele, Lea and Flood, "Fast splittable pseudorandom number
# generators", OOPSLA 2014; the generator of Java's SplittableRandom) as int64.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
# Elements per chunk of seeded_exponential's int64 work (~4 temporaries of 8 bytes):
# on the CPU small enough for the temporaries to stay in cache (128 rows of a 49k-token
# vocabulary: 200 ms in one chunk, fresh pages for every temporary; 15.5 ms in chunks
# of 2**18, as fast as the per-row torch.Generator loop it replaced, 16.2 ms), on CUDA
# large enough for few launches.
_SEEDED_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}
_TOKEN_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask the sign copies)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponential(row_seeds: list[int], vocab_size: int,
                       device: torch.device) -> torch.Tensor:
    """Exp(1) draws for seeded rows: `[len(row_seeds), vocab_size]` float32.

    Draw (r, t) is a pure function of (row_seeds[r], t): splitmix64's output function
    applied to the counter `row_seeds[r] + (t + 1) * gamma` (mod 2**64), whose top 24
    bits give U in [0, 1), and -log(U). The same on every device and in any batch. U = 0
    gives +inf, which the exponential race reads as the lowest score (an event of
    probability 2**-24 per token, as for the CPU's unseeded draws). Row seeds are
    `step_seed` values in [0, 2**63).
    """
    counters = _TOKEN_COUNTERS.get((device, vocab_size))
    if counters is None:
        counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * _GAMMA
        _TOKEN_COUNTERS[(device, vocab_size)] = counters
    seeds = to_device(row_seeds, torch.int64, device).unsqueeze(1)
    out = torch.empty(len(row_seeds), vocab_size, dtype=torch.float32, device=device)
    chunk = _SEEDED_CHUNK.get(device.type, 1 << 24)
    cols = min(vocab_size, chunk)
    rows = max(1, chunk // cols)
    for r0 in range(0, len(row_seeds), rows):
        for c0 in range(0, vocab_size, cols):
            z = seeds[r0:r0 + rows] + counters[c0:c0 + cols]
            z = (z ^ _shift_right(z, 30)) * _MIX1
            z = (z ^ _shift_right(z, 27)) * _MIX2
            z ^= _shift_right(z, 31)
            u = _shift_right(z, 40).to(torch.float32).mul_(2.0**-24)
            torch.neg(u.log_(), out=out[r0:r0 + rows, c0:c0 + cols])
    return out


def _exponential_(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill `q` (float32, in place) with Exp(1) draws from `generator`.

    On CUDA torch's `exponential_` is one fused kernel. On the CPU it took 0.77 ms for
    one 49,152-token row (torch 2.13, measured alone) against 0.13 ms for -log(U) with
    U uniform on [0, 1) (inverse transform sampling: the same distribution), so the CPU
    draws that way (end to end ~0.3 ms less per token of the default model at batch 1,
    docs/benchmarks.md). U = 0 gives +inf, which the race reads as the lowest score for
    that token (an event of probability 2**-24 per token).
    """
    if q.device.type == "cuda":
        return q.exponential_(generator=generator)
    return q.uniform_(generator=generator).log_().neg_()
