"""`--speculative-config` / `LLM(speculative_config={...})`: vLLM's keys and defaults.

Accepted keys (vLLM's `SpeculativeConfig`, same meaning):

- `method`: "ngram" (prompt lookup), "draft_model" (a smaller model with the same
  tokenizer; implied when `model` is given without a method);
- `num_speculative_tokens` (k): draft tokens proposed per request per step, >= 1;
- `prompt_lookup_min` / `prompt_lookup_max` (ngram): the shortest and longest suffix
  n-gram matched; vLLM's defaults: both 5 when neither is given, else the one given;
- `model`: the draft model's directory or hub id (draft_model), or the head
  checkpoint's: "eagle" (EAGLE-1/2 head on the target's final hidden states),
  "eagle3" (EAGLE-3 head on three of the target's layers), "medusa" (Medusa heads,
  a top-1 chain: num_speculative_tokens <= the checkpoint's heads). See
  flowengine/executor/eagle_heads.py for the layouts.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa")
# The methods whose "model" is a head reading the target's hidden states.
HEAD_METHODS = ("eagle", "eagle3", "medusa")
# Methods vLLM knows that FlowEngine does not build (yet): refused by name.
_UNSUPPORTED = ("mlp_speculator", "deepseek_mtp", "mtp", "ngram_gpu", "suffix")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "model"}
# The n-gram lengths vLLM picks when the config gives neither bound.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration (see the module docstring).

    Raises ValueError from `from_dict` / `parse` naming the key and what to change.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From a JSON string (the CLI flag), a dict (`LLM(...)`), a config, or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(d) - _KEYS, key=str)  # keys of a dict need not be strings
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; FlowEngine takes "
                             f"{sorted(_KEYS)}")
        method = d.get("method")
        model = d.get("model")
        if method is None:
            if model is None:
                raise ValueError('speculative_config needs "method" ("ngram") or "model" '
                                 "(a draft model's directory)")
            method = "draft_model"
        if method in _UNSUPPORTED:
            raise ValueError(f"speculative_config: method {method!r} is not supported; use "
                             f"one of {METHODS}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got "
                             f"{method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            if model is not None:
                raise ValueError('speculative_config: method "ngram" takes no "model"')
            # The values given are checked before a missing bound copies the other, so
            # the error names the key the user wrote.
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                     f"got {v!r}")
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            return cls("ngram", k, lo, hi)
        if lo is not None or hi is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max apply to method "
                             '"ngram" only')
        what = "draft model's" if method == "draft_model" else f"{method} head checkpoint's"
        if model is None:
            raise ValueError(f'speculative_config: method "{method}" needs "model", the '
                             f"{what} directory or hub id")
        if not isinstance(model, str) or not model:
            raise ValueError('speculative_config: "model" must be a non-empty string (the '
                             f"{what} directory or hub id), got {model!r}")
        return cls(method, k, model=model)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def uses_model(self) -> bool:
        """Whether `model` names a checkpoint (a draft model or EAGLE / Medusa heads)."""
        return self.method != "ngram"

    def to_dict(self) -> dict[str, Any]:
        """The JSON object this config parses from (for logs and child processes)."""
        if self.method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_min": self.prompt_lookup_min,
                    "prompt_lookup_max": self.prompt_lookup_max}
        return {"method": self.method, "model": self.model,
                "num_speculative_tokens": self.num_speculative_tokens}
