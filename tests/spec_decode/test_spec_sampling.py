"""Random sampling with drafts keeps the target's distribution (and seeds' tokens).

A toy model with a small vocabulary: a first-order Markov chain over V = 6 tokens
(random transition matrix, fixed per run), run through the real `Executor` and
`Sampler` by a runner that returns the chain's log-probabilities as logits. Each
request starts after token 0 and emits its first two tokens; with speculation every
step carries the drafts [d1, d2] (one likely, one unlikely token under the chain), so
all acceptance paths occur. Chi-square tests (statistic and critical value computed
here, alpha = 1e-4, Wilson-Hilferty quantile):
- goodness of fit of the 36 token pairs against the chain's exact pair distribution
  (temperature 1), with and without speculation;
- homogeneity of spec and no-spec samples under temperature 0.7 + top_p 0.9;
- seeded requests emit identical tokens with and without speculation.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowengine.distributed.tp_group import SINGLE_RANK
from flowengine.executor.executor import Executor
from flowengine.executor.input_batch import RequestState
from flowengine.executor.model_runner import ModelOutput, ModelRunner
from flowengine.messages import StepPlan
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

V = 6
NUM_SAMPLES = 6000
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (df >= 10: < 1% off)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class MarkovRunner(ModelRunner):
    """The toy model: logits of row j = log P[last token of (tokens + drafts[:j])]."""

    def __init__(self, transition: torch.Tensor) -> None:  # no weights, no KV cache
        self.log_p = transition.log()
        self.requests = {}
        self.tp = SINGLE_RANK
        self.device = torch.device("cpu")
        self.draft_runner = None
        self.input_batch = SimpleNamespace(block_size=16)

    def add(self, req_id: str, params: SamplingParams) -> None:
        self.requests[req_id] = RequestState(req_id, [0], 1, params, None, [0] * 8, 0)

    def step(self, req_ids: list[str], drafts: list[int] | None) -> ModelOutput:
        rows, draft_lists = [], []
        for rid in req_ids:
            state = self.requests[rid]
            d = drafts if drafts is not None and len(state.token_ids) == 1 else []
            history = state.token_ids + d
            state.token_ids.extend(d)
            state.num_draft_tokens = len(d)
            state.num_computed_tokens = len(history)
            for j in range(len(d) + 1):
                rows.append(history[len(history) - len(d) - 1 + j])
            draft_lists.append(d)
        logits = self.log_p[torch.tensor(rows)]
        return ModelOutput(req_ids, logits, draft_lists if drafts is not None else None)


def sample_pairs(transition: torch.Tensor, params: SamplingParams, drafts: list[int] | None,
                 seeded: bool = False, n: int = NUM_SAMPLES) -> list[tuple[int, int]]:
    runner = MarkovRunner(transition)
    executor = Executor(runner, Sampler(seed=None))
    ids = [str(i) for i in range(n)]
    for i, rid in enumerate(ids):
        runner.add(rid, params.clone(seed=i) if seeded else params)
    step = 0
    while True:
        todo = [rid for rid in ids if len(runner.requests[rid].token_ids) < 3]
        if not todo:
            break
        executor.sample(StepPlan(step, [], [], []), runner.step(todo, drafts))
        step += 1
    return [tuple(runner.requests[rid].token_ids[1:3]) for rid in ids]


def counts(pairs: list[tuple[int, int]]) -> list[int]:
    c = [0] * (V * V)
    for a, b in pairs:
        c[a * V + b] += 1
    return c


@pytest.fixture(scope="module")
def chain() -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(16)
    transition = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.05
    transition /= transition.sum(dim=1, keepdim=True)
    likely = int(transition[0].argmax())
    unlikely = int(transition[likely].argmin())
    return transition.float(), [likely, unlikely]


@pytest.mark.parametrize("speculate", [False, True])
def test_pairs_fit_the_exact_distribution(chain, speculate: bool) -> None:
    transition, drafts = chain
    pairs = sample_pairs(transition, SamplingParams(temperature=1.0, max_tokens=4),
                         drafts if speculate else None)
    t = transition.double()
    expected = [NUM_SAMPLES * float(t[0, a] * t[a, b]) for a in range(V) for b in range(V)]
    observed = counts(pairs)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    assert stat < chi2_critical(V * V - 1), (stat, observed, expected)
    if speculate:  # every acceptance path happened
        first = [p[0] for p in pairs]
        assert first.count(drafts[0]) > 0 and len(set(first)) == V


def test_spec_and_no_spec_are_indistinguishable_under_top_p(chain) -> None:
    transition, drafts = chain
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4)
    a = counts(sample_pairs(transition, params, None))
    b = counts(sample_pairs(transition, params, drafts))
    cells = [(x, y) for x, y in zip(a, b, strict=True) if x + y > 0]
    n_a, n_b = sum(a), sum(b)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            e = total * n / (n_a + n_b)
            stat += (observed - e) ** 2 / e
    assert len(cells) >= 11
    assert stat < chi2_critical(len(cells) - 1), (stat, a, b)


def test_seeded_requests_emit_the_same_tokens(chain) -> None:
    transition, drafts = chain
    params = SamplingParams(temperature=1.0, max_tokens=4)
    plain = sample_pairs(transition, params, None, seeded=True, n=300)
    spec = sample_pairs(transition, params, drafts, seeded=True, n=300)
    assert plain == spec
    assert len(set(plain)) > 10
