"""--speculative-config / LLM(speculative_config=...) given wrong types: a ValueError
that names the key the user wrote (never a TypeError, never another key's name)."""

from __future__ import annotations

import re

import pytest

from flowengine.config import EngineArgs
from flowengine.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize(("value", "message"), [
    # A dict from LLM(...) may have keys that are not strings.
    ({"method": "ngram", "num_speculative_tokens": 2, 3: 1, "x": 2},
     "unknown key(s) [3, 'x']"),
    # Only the maximum given (the minimum copies it): the error names the maximum.
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1.5},
     "prompt_lookup_max must be an integer >= 1, got 1.5"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1e400}',
     "prompt_lookup_max must be an integer >= 1, got inf"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "3"},
     "prompt_lookup_min must be an integer >= 1, got '3'"),
    # A model of the wrong type is not "missing".
    ({"model": 5, "num_speculative_tokens": 2},
     '"model" must be a non-empty string (the draft model\'s directory or hub id), got 5'),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2},
     '"model" must be a non-empty string'),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": NaN}',
     "num_speculative_tokens must be an integer >= 1, got nan"),
])  # fmt: skip
def test_wrong_types_name_the_key(value, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SpeculativeConfig.parse(value)
    if isinstance(value, dict):  # LLM(...) and EngineArgs check it the same way
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineArgs(speculative_config=value)


def test_the_bound_given_is_kept() -> None:
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_max": 3})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_min": 2})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


def test_a_missing_draft_model_is_refused_before_the_target_loads(tmp_path) -> None:
    from flowengine.engine import builder

    missing = tmp_path / "no-such-draft"
    args = EngineArgs(speculative_config={"model": str(missing), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config.model: .*no-such-draft"):
        builder._check_draft_model(args)
    builder._check_draft_model(EngineArgs(speculative_config={
        "method": "ngram", "num_speculative_tokens": 2}))  # no draft model: nothing to find
