"""Which runner a model gets and how its embeddings are pooled.

vLLM's names: `runner` is "generate" or "pooling" ("auto" picks "pooling" for
encoder-only architectures, "generate" for the rest; vLLM's `--runner`), and a
`PoolerConfig` says the pooling type and whether vectors are L2-normalised (vLLM's
`--pooler-config`). For a model with sentence-transformers files the defaults come from
them, as sentence-transformers itself applies them: `modules.json` lists a Pooling
module (its `config.json` names the mode) and, when vectors are normalised, a Normalize
module. Without them: CLS pooling for encoders (vLLM's default for BERT), last-token
pooling for decoders (decoder embedding models such as e5-mistral, gte-Qwen2), and
normalisation on (vLLM's default for embedding).

Pure Python, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

PoolingType = Literal["CLS", "MEAN", "LAST"]
POOLING_TYPES = ("CLS", "MEAN", "LAST")
RUNNERS = ("auto", "generate", "pooling")

# sentence-transformers' Pooling config keys -> pooling type.
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model reduces a request's token states to one vector.

    pooling_type: "CLS" (first token), "MEAN" (mean over the prompt's tokens) or
        "LAST" (last token). normalize: L2-normalise each vector (after truncation to
        `dimensions`, when a request asks for fewer). matryoshka_dimensions: the
        dimensions a Matryoshka model was trained for (config.json's
        `matryoshka_dimensions`), empty when any is allowed; None when the model is not
        a Matryoshka model, so a request's `dimensions` is refused.
    """

    pooling_type: PoolingType
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """Raise ValueError unless a request may ask for `dimensions` (vLLM's rules and
        messages: only Matryoshka models, within 1..hidden_size, one of the trained
        sizes when the model lists them)."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("the model does not support matryoshka representation; "
                             "changing output dimensions would give poor results: leave "
                             "'dimensions' unset")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}], got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"the model supports dimensions {list(self.matryoshka_dimensions)}"
                             f" only, got {dimensions}")


def resolve_runner(runner: str, is_encoder_only: bool, architecture: str) -> str:
    """"generate" or "pooling" for `runner` ("auto" picks by architecture). Raises
    ValueError for an unknown runner or generation on an encoder-only model."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner == "auto":
        return "pooling" if is_encoder_only else "generate"
    if runner == "generate" and is_encoder_only:
        raise ValueError(f"{architecture} is an encoder-only model without a language-model "
                         "head: serve it with runner 'pooling' (--runner pooling)")
    return runner


def resolve_pooler_config(model_path: str, is_encoder_only: bool,
                          user: dict[str, Any] | None = None) -> PoolerConfig:
    """The model's PoolerConfig: `user` fields (--pooler-config: pooling_type,
    normalize) over the sentence-transformers files over the defaults (module
    docstring). Raises ValueError for an unknown field or pooling type, or a
    sentence-transformers pooling mode FlowEngine does not implement."""
    user = user or {}
    unknown = sorted(set(user) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"unknown pooler_config field(s) {unknown}; known: "
                         "pooling_type, normalize")
    pooling_type: str = "CLS" if is_encoder_only else "LAST"
    normalize = True
    # A pooling type the user chose needs none of the model's (which may be one
    # FlowEngine does not implement).
    st = _sentence_transformers_pooling(model_path, check_mode="pooling_type" not in user)
    if st is not None:
        pooling_type, normalize = st
    if user:
        pooling_type = str(user.get("pooling_type", pooling_type)).upper()
        normalize = user.get("normalize", normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {normalize!r}")
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
    hf = _read_json(os.path.join(model_path, "config.json")) or {}
    dims = hf.get("matryoshka_dimensions")
    is_matryoshka = bool(hf.get("is_matryoshka")) or bool(dims)
    return PoolerConfig(pooling_type, normalize, is_matryoshka,  # type: ignore[arg-type]
                        tuple(int(d) for d in dims or ()))


def sentence_transformers_max_seq_length(model_path: str) -> int | None:
    """`max_seq_length` of sentence_bert_config.json (sentence-transformers truncates its
    inputs there; vLLM caps max_model_len at it), or None without the file."""
    cfg = _read_json(os.path.join(model_path, "sentence_bert_config.json"))
    value = None if cfg is None else cfg.get("max_seq_length")
    return int(value) if value else None


def _sentence_transformers_pooling(model_path: str, check_mode: bool = True
                                   ) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and the Pooling module's config, or
    None when the model has no sentence-transformers modules. check_mode False: an
    unsupported mode is not an error (the caller replaces it)."""
    modules = _read_json(os.path.join(model_path, "modules.json"))
    if not isinstance(modules, list):
        return None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return None
    cfg = _read_json(os.path.join(model_path, str(pooling.get("path", "")), "config.json")) or {}
    modes = [t for key, t in _ST_MODES.items() if cfg.get(key)]
    unsupported = [key for key in _ST_UNSUPPORTED if cfg.get(key)]
    if (unsupported or len(modes) > 1) and check_mode:
        raise ValueError(f"sentence-transformers pooling {unsupported or modes} of {model_path} "
                         "is not supported (one of CLS, mean, last token); pass "
                         "--pooler-config '{\"pooling_type\": ...}' to choose one")
    if not modes:
        mode = str(cfg.get("pooling_mode", "")).lower()
        modes = [{"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}.get(mode, "MEAN")]
    return modes[0], "Normalize" in types


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
