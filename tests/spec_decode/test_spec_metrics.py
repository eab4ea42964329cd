"""The spec_decode counters in /metrics (vLLM's names under our prefix) and from
AsyncEngine.get_stats (SchedulerStats over the outputs ring)."""

from __future__ import annotations

from prometheus_client import generate_latest

from flowengine.engine.protocol import EngineStats
from flowengine.messages import EngineOutputs, SchedulerStats
from flowengine.metrics import ServingMetrics


def _lines(stats: EngineStats) -> list[str]:
    text = generate_latest(ServingMetrics(lambda: stats, "m").registry).decode()
    return [line for line in text.splitlines() if line.startswith("flowengine:spec_decode")]


def test_exposition_names_and_values() -> None:
    stats = EngineStats(spec_decode_num_drafts_total=5, spec_decode_num_draft_tokens_total=20,
                        spec_decode_num_accepted_tokens_total=9,
                        spec_decode_num_accepted_tokens_per_pos=[5, 3, 1, 0])
    labels = 'engine="0",model_name="m"'
    assert sorted(_lines(stats)) == sorted([
        f"flowengine:spec_decode_num_drafts_total{{{labels}}} 5.0",
        f"flowengine:spec_decode_num_draft_tokens_total{{{labels}}} 20.0",
        f"flowengine:spec_decode_num_accepted_tokens_total{{{labels}}} 9.0",
        *(f'flowengine:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}}'
          f" {v}.0" for p, v in enumerate([5, 3, 1, 0])),
    ])


def test_zero_without_speculation() -> None:
    lines = _lines(EngineStats())
    assert len(lines) == 3 and all(line.endswith(" 0.0") for line in lines)


def test_scheduler_stats_cross_the_ring() -> None:
    import msgspec

    stats = SchedulerStats(spec_decode_num_drafts_total=2,
                           spec_decode_num_accepted_tokens_per_pos=[2, 1])
    msg = EngineOutputs([], stats=stats)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineOutputs)
    assert back.stats == stats


def test_draft_fields_cross_the_rings() -> None:
    """Multiproc placement: drafts in the plan and a draft model's in the result."""
    import msgspec

    from flowengine.messages import CachedRequestData, SampledTokens, StepPlan, StepResult

    plan = StepPlan(3, [], [CachedRequestData("a", [4], 10, [7, 8]),
                            CachedRequestData("b", [], 5)], [3, 1])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
    assert back == plan and back.cached_reqs[1].draft_token_ids == []
    result = StepResult(3, [SampledTokens("a", [7, 1], draft_token_ids=[2, 3])])
    back_result = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult)
    assert back_result.sampled[0].draft_token_ids == [2, 3]
