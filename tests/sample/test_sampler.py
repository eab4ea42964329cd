"""Sampler: greedy, seeded reproducibility, min_tokens, logprobs, batching flags."""

from __future__ import annotations

import os
import random

import pytest
import torch

from flowengine.sample.metadata import SamplingMetadata, SamplingState, step_seed
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 64


@pytest.mark.parametrize("device", DEVICES)
def test_all_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(8, 1000, device=device)
    before = logits.clone()
    states = [SamplingState(SamplingParams(temperature=0), [1], []) for _ in range(8)]
    out = Sampler()(logits, states)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.device == logits.device
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert torch.equal(logits, before)
    assert out.tolists() == (logits.argmax(dim=-1).tolist(), [None] * 8)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_of_a_mixed_batch_are_argmax(device: str) -> None:
    logits = torch.randn(6, 300, device=device)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=5)] * 3
    out = Sampler()(logits, [SamplingState(p, [1], []) for p in params])
    assert out.sampled_token_ids[::2].tolist() == logits[::2].argmax(dim=-1).tolist()


def test_flags_of_a_plain_greedy_batch_skip_everything() -> None:
    states = [SamplingState(SamplingParams(temperature=0, top_k=3, top_p=0.5), [1], [2])] * 3
    md = SamplingMetadata.from_states(states, VOCAB, "cpu")
    assert md.all_greedy and not md.all_random
    assert md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p and md.no_min_tokens
    assert md.temperature is None and md.is_greedy is None and md.logprob_rows is None
    assert md.seeded_rows == []


def test_metadata_neutral_values_for_rows_without_a_stage() -> None:
    states = [
        SamplingState(SamplingParams(temperature=0.5, top_k=3), [1], []),
        SamplingState(SamplingParams(temperature=0), [1], []),
        SamplingState(SamplingParams(top_k=500, top_p=0.9, seed=7), [1], [4, 4]),
    ]
    md = SamplingMetadata.from_states(states, VOCAB, "cpu")
    assert md.temperature.tolist() == [0.5, 1.0, 1.0]
    assert md.is_greedy.tolist() == [False, True, False]
    assert md.top_k.tolist() == [3, VOCAB, VOCAB]
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert md.min_p is None
    assert (md.seeded_rows, md.row_seeds) == ([2], [step_seed(7, 2)])


def test_step_seed_values() -> None:
    assert step_seed(0, 0) == 0
    assert step_seed(1, 2) == 1_000_005
    assert step_seed(-1, 0) == 2**63 - 1_000_003
    assert step_seed(2**62, 0) == (2**62 * 1_000_003) % 2**63


def _generate(sampler: Sampler, batches: list[list[tuple[str, SamplingParams, torch.Tensor]]]):
    """Run len(batches) steps; each step's batch is a list of (name, params, logits row).

    Every request appends its token to its own output, as the engine would. Returns
    {name: tokens}.
    """
    outputs: dict[str, list[int]] = {}
    for batch in batches:
        logits = torch.stack([row for _, _, row in batch])
        states = [
            SamplingState(params, [1, 2, 3], outputs.setdefault(name, []), 0)
            for name, params, _ in batch
        ]
        tokens = sampler(logits, states).tolists()[0]
        for (name, _, _), token in zip(batch, tokens, strict=True):
            outputs[name].append(token)
    return outputs


def test_seeded_request_is_independent_of_batch_and_position() -> None:
    num_steps = 12
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    rows = {name: torch.randn(VOCAB) for name in "ABCDE"}
    others = {
        "B": SamplingParams(temperature=1.0, seed=99),
        "C": SamplingParams(temperature=0.8),  # unseeded
        "D": SamplingParams(temperature=0),  # greedy
        "E": SamplingParams(temperature=1.0, top_k=8, seed=1234 + 1),
    }
    alone = _generate(Sampler(seed=1), [[("A", target, rows["A"])]] * num_steps)["A"]

    rng = random.Random()
    mixed_batches = []
    for _ in range(num_steps):
        names = rng.sample(list(others), k=rng.randint(0, len(others)))
        batch = [("A", target, rows["A"])] + [(n, others[n], rows[n]) for n in names]
        rng.shuffle(batch)
        mixed_batches.append(batch)
    mixed = _generate(Sampler(seed=2), mixed_batches)

    assert mixed["A"] == alone
    for name in ("B", "E"):  # the other seeded requests too, over the steps they ran
        steps = [[(name, others[name], rows[name])]] * len(mixed.get(name, []))
        assert _generate(Sampler(seed=3), steps).get(name, []) == mixed.get(name, [])
    assert _generate(Sampler(), [[("A", target, rows["A"])]] * num_steps)["A"] == alone
    assert len(set(alone)) > 1  # it really samples
    reseeded = SamplingParams(temperature=1.5, top_p=0.95, seed=4321)
    other_seed = _generate(Sampler(seed=1), [[("A", reseeded, rows["A"])]] * num_steps)["A"]
    assert other_seed != alone


def test_seeded_token_is_reproduced_after_a_restart() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(1, VOCAB)
    output: list[int] = []
    sampler = Sampler()
    for _ in range(8):
        output.append(sampler(logits, [SamplingState(params, [1], list(output))]).tolists()[0][0])
    # A fresh engine recomputing the request from the tokens already delivered.
    for k in range(8):
        again = Sampler()(logits, [SamplingState(params, [1], output[:k])]).tolists()[0][0]
        assert again == output[k]


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(16, VOCAB)
    states = [SamplingState(SamplingParams(temperature=1.0), [1], []) for _ in range(16)]
    first = Sampler(seed=3)(logits, states).sampled_token_ids
    assert torch.equal(Sampler(seed=3)(logits, states).sampled_token_ids, first)


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    eos, stop = 3, 5
    logits = torch.tensor([[0.0, 2.0, 0.0, 9.0, 0.0, 8.0, 0.0, 0.0]]).repeat(4, 1)
    base = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop, 100])
    states = [
        SamplingState(base, [1], [6], eos),  # 1 < 2: eos and stop masked -> token 1
        SamplingState(base, [1], [6, 6], eos),  # min_tokens reached -> eos
        SamplingState(base.clone(ignore_eos=True), [1], [], eos),  # eos allowed, stop masked
        SamplingState(base.clone(stop_token_ids=None), [1], [], None),  # nothing to mask
    ]
    md = SamplingMetadata.from_states(states, 8, "cpu")
    assert md.min_tokens_rows.tolist() == [0, 0, 2]
    assert md.min_tokens_token_ids.tolist() == [eos, stop, stop]  # 100 is out of vocab
    assert Sampler().sample(logits, md).sampled_token_ids.tolist() == [1, eos, eos, eos]


def test_logprobs_from_raw_logits() -> None:
    logits = torch.randn(5, 50)
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, seed=11, logprobs=3),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=2),
    ]
    states = [SamplingState(p, [1, 2], [int(logits[i].argmax())] * 3) for i, p in enumerate(params)]
    out = Sampler()(logits, states)
    tokens, logprobs = out.tolists()
    assert tokens == out.sampled_token_ids.tolist()
    assert logprobs[2] is None
    reference = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params):
        if p.logprobs is None:
            continue
        lp, ref = logprobs[row], reference[row]
        top = ref.topk(p.logprobs)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == top.values.tolist()
        assert lp.sampled_logprob == ref[tokens[row]].item()
        assert lp.sampled_rank == 1 + int((ref > ref[tokens[row]]).sum())
    assert logprobs[0].top_token_ids == [] and logprobs[0].sampled_rank == 1
    # The frequency penalty (-6) pushed row 4 off its raw argmax: rank > 1.
    assert tokens[4] != int(logits[4].argmax()) and logprobs[4].sampled_rank > 1


def test_shape_mismatch_is_reported() -> None:
    md = SamplingMetadata.from_states([SamplingState(SamplingParams(), [1], [])], VOCAB, "cpu")
    with pytest.raises(ValueError, match="do not match the sampling metadata"):
        Sampler().sample(torch.randn(2, VOCAB), md)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seeded", [False, True])
def test_random_sampling_draws_from_the_tempered_softmax(device: str, seeded: bool) -> None:
    """The exponential race picks token i with probability softmax(logits / T)_i: 6,000
    rows of one 8-token distribution (unseeded: one batch generator; seeded: each row
    its own seed), counts against the expected ones by Pearson's chi-squared (7 degrees
    of freedom; 35 is exceeded with probability ~1e-5 by a correct sampler)."""
    rows, temperature = 6000, 0.8
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    logits = base.repeat(rows, 1).to(device)
    states = [SamplingState(SamplingParams(temperature=temperature,
                                           seed=i if seeded else None), [1], [])
              for i in range(rows)]
    ids = Sampler(seed=1234)(logits, states).sampled_token_ids.cpu()
    counts = torch.bincount(ids, minlength=8).double()
    expected = rows * torch.softmax(base.double() / temperature, dim=0)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35.0, (chi2, counts.tolist(), expected.tolist())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the fused race is a Triton kernel (CUDA or TRITON_INTERPRET=1)")
def test_the_fused_race_draws_the_unfused_tokens(monkeypatch) -> None:
    """The one-kernel race (Sampler._race_fused, CUDA's path for batches without top-k,
    top-p and min-p) picks the same token as the torch path for seeded rows (the same
    counter-based U), follows the argmax for greedy rows in a mixed batch, and draws
    unseeded rows from the tempered softmax (chi-squared, as the test above)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = 48
    logits = (torch.randn(rows, VOCAB) * 2).to(device)
    states = [SamplingState(SamplingParams(temperature=0.0 if i % 5 == 0 else 0.7 + i / 100,
                                           seed=None if i % 5 == 0 else 1000 + i), [1],
                            list(range(i % 7)))
              for i in range(rows)]
    unfused = Sampler(seed=1)(logits, states).sampled_token_ids
    monkeypatch.setattr(Sampler, "_can_fuse", staticmethod(lambda logits, metadata: True))
    fused = Sampler(seed=1)(logits, states).sampled_token_ids
    assert torch.equal(fused, unfused)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, 1.5], device=device)
    many = 2000  # the interpreter runs one program per row; smallest expected count ~12
    draws = [SamplingState(SamplingParams(temperature=0.8, seed=None if i % 2 else i), [1], [])
             for i in range(many)]
    ids = Sampler(seed=7)(base.repeat(many, 1), draws).sampled_token_ids.cpu()
    counts = torch.bincount(ids, minlength=8).double()
    expected = many * torch.softmax(base.cpu().double() / 0.8, dim=0)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35.0, (chi2, counts.tolist())


def test_request_states_batch_like_sampling_states() -> None:
    """The executor hands its RequestStates to the sampler: the metadata equals the one
    built from SamplingStates, and each state's static row is computed once."""
    from flowengine.executor.input_batch import RequestState

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=3),
              SamplingParams(temperature=1.2, min_tokens=4, logprobs=2),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, top_p=0.8)]
    reqs = [RequestState(str(i), [1, 2, 3, 4, 5 + i], 3, p, 2, [0], 5)
            for i, p in enumerate(params)]
    plain = [r.sampling_state() for r in reqs]
    for _ in range(2):
        got = SamplingMetadata.from_states(reqs, VOCAB, "cpu")
        want = SamplingMetadata.from_states(plain, VOCAB, "cpu")
        for field in SamplingMetadata.__dataclass_fields__:
            a, b = getattr(got, field), getattr(want, field)
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), field
    rows = [r.sampling_row for r in reqs]
    assert all(row is not None and row[0] == VOCAB for row in rows)
    SamplingMetadata.from_states(reqs, VOCAB, "cpu")
    assert all(r.sampling_row is row for r, row in zip(reqs, rows, strict=True))
    assert [r.reads_token_values for r in reqs] == [False, False, False, True]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, logprobs=3),
    SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=-0.5),
])
def test_a_batch_of_equal_params_shares_one_static_row(params: SamplingParams) -> None:
    """Requests of equal params (distinct objects, as decoded from each plan) share one
    interned static row, and the batch's metadata equals the SamplingStates' one, also
    once a request of other params joins."""
    from flowengine.executor.input_batch import RequestState

    def request(i: int, p: SamplingParams) -> RequestState:
        return RequestState(str(i), [1, 2, 3, 4, 5 + i], 3, p, 2, [0], 5)

    reqs = [request(i, SamplingParams(**{f: getattr(params, f) for f in (
        "temperature", "top_k", "top_p", "min_p", "logprobs", "frequency_penalty",
        "presence_penalty")})) for i in range(5)]
    for batch in (reqs, [*reqs, request(9, SamplingParams(temperature=0.5, top_k=2))]):
        for _ in range(2):
            got = SamplingMetadata.from_states(batch, VOCAB, "cpu")
            want = SamplingMetadata.from_states([r.sampling_state() for r in batch], VOCAB, "cpu")
            for field in SamplingMetadata.__dataclass_fields__:
                a, b = getattr(got, field), getattr(want, field)
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), field
    assert all(r.sampling_row is reqs[0].sampling_row for r in reqs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_path", [True, False])
@pytest.mark.parametrize("temperature", [1e30, 3.5e38, 1e300])
def test_top_k_holds_at_temperatures_beyond_float32(device: str, host_path: bool,
                                                   temperature: float, monkeypatch) -> None:
    """A finite temperature above float32's max (SamplingParams accepts any finite one)
    became inf in the float32 metadata: logits / inf = 0 tied every token, so top-k
    kept the whole vocabulary. Whatever the temperature, a row samples from its top k
    (top-p and min-p act on the tempered probabilities, uniform at such temperatures)."""
    if not host_path:
        monkeypatch.setattr(Sampler, "_can_race_on_host", staticmethod(lambda logits: False))
    rows = 48
    logits = torch.randn(rows, VOCAB).to(device)
    params = [SamplingParams(temperature=temperature, top_k=2, seed=i) for i in range(rows)]
    ids = Sampler(seed=3)(logits, [SamplingState(p, [1], []) for p in params]).sampled_token_ids
    top2 = logits.topk(2, dim=-1).indices
    assert (ids.unsqueeze(1) == top2).any(dim=1).all(), (ids.tolist(), top2.tolist())
