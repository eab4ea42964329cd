"""--speculative-config parsing: vLLM's keys and defaults, clear errors, the flag."""

from __future__ import annotations

import pytest

from flowengine.config import EngineArgs
from flowengine.spec_decode import SpeculativeConfig


def test_ngram_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 5, 5)
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                '"prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert c.to_dict() == {"method": "ngram", "num_speculative_tokens": 2,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 2}
    assert SpeculativeConfig.parse(None) is None


def test_draft_model_is_implied_by_model() -> None:
    c = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 3)


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be an integer >= 1"),
    ({"method": "mlp_speculator", "model": "/m", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "magic", "num_speculative_tokens": 2}, "method must be one of"),
    ({"num_speculative_tokens": 2}, 'needs "method"'),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown key"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_errors_name_the_key(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_engine_args_validate_it() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                       "prompt_lookup_min": -1})
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineArgs(tensor_parallel_size=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_cli_flag() -> None:
    import argparse

    from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["m", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3}'])
    args = engine_args_from(ns)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--speculative-config", "[3]"])


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_head_methods_take_a_model(method) -> None:
    c = SpeculativeConfig.parse({"method": method, "model": "/h", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == (method, "/h", 3)
    assert c.uses_model and not c.uses_draft_model
    assert c.to_dict() == {"method": method, "model": "/h", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=f'method "{method}" needs "model"'):
        SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min/max apply to method"):
        SpeculativeConfig.parse({"method": method, "model": "/h", "num_speculative_tokens": 3,
                                 "prompt_lookup_min": 2})
