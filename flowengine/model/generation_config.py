"""Model-recommended sampling defaults from `generation_config.json` (vLLM's
`--generation-config auto|vllm|DIR`).

vLLM (`ModelConfig.get_diff_sampling_param`) reads the Hugging Face generation config of
the model (`auto`, the default), of another folder (a path), or none (`vllm`), applies
`--override-generation-config` on top, and keeps these keys when set:
`repetition_penalty`, `temperature`, `top_k`, `top_p`, `min_p`, and `max_new_tokens`
(renamed `max_tokens`). They become the defaults of every request that does not set
the field itself: request > model defaults > `SamplingParams` defaults. This file only
reads; `apply_to_request_fields` / `default_params` apply them.

vLLM takes `GenerationConfig.to_diff_dict()`, the keys that differ from transformers'
defaults; since transformers v5 those defaults are all None, so that is every key the
file sets, which is what is read here (without importing transformers).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json keys vLLM takes as sampling defaults, in vLLM's order.
GENERATION_CONFIG_PARAMS = (
    "repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens",
)  # fmt: skip


def _read(folder: Path) -> dict[str, Any] | None:
    file = folder / "generation_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def load_generation_defaults(
    model_path: str,
    generation_config: str = "auto",
    override: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The sampling defaults the model recommends, as `SamplingParams` keyword arguments.

    model_path: the model's local folder (or a `.gguf` file: no generation config).
    generation_config: "auto" (the model's generation_config.json), "vllm" (none) or a
        folder holding a generation_config.json.
    override: keys applied over the file (vLLM's `--override-generation-config`).

    Returns e.g. {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}: only the keys
    of GENERATION_CONFIG_PARAMS that are set (not null), `max_new_tokens` as
    `max_tokens`. Raises ValueError when `generation_config` is a folder without a
    generation_config.json, or the file is not a JSON object.
    """
    config: dict[str, Any] = {}
    if generation_config == "auto":
        path = Path(model_path).expanduser()
        if path.is_dir():
            config = _read(path) or {}
    elif generation_config != "vllm":
        folder = Path(generation_config).expanduser()
        found = _read(folder) if folder.is_dir() else None
        if found is None:
            raise ValueError(
                f"--generation-config {generation_config!r}: no generation_config.json "
                "there; give a folder that holds one, 'auto' (the model's) or 'vllm' (none)"
            )
        config = found
    config.update(override or {})
    defaults = {k: config[k] for k in GENERATION_CONFIG_PARAMS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        from flowengine.sampling_params import SamplingParams

        SamplingParams(**defaults)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"the generation config's sampling defaults {defaults} are invalid: {err}; fix "
            "the file, override the key with --override-generation-config, or pass "
            "--generation-config vllm"
        ) from err
    if defaults:
        logger.warning(
            "default sampling parameters come from the model's generation config %s; "
            "pass --generation-config vllm to use FlowEngine's own defaults",
            defaults,
        )
    return defaults
