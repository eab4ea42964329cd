"""Loading a Hugging Face fast tokenizer and reading what the engine needs from it.

The tokenizer itself is `transformers`' (Rust `tokenizers` underneath); FlowEngine adds
only loading rules (a model directory, a hub id or a GGUF file), the end-of-sequence
ids the engine stops on, and `encode` with the tokenizer's own special-token default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(
    path_or_name: str, revision: str | None = None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer of a model.

    path_or_name: a local model directory (tokenizer.json / tokenizer_config.json), a
    `.gguf` file (its embedded tokenizer, via transformers' GGUF support) or a Hugging
    Face hub id. revision: a hub branch, tag or commit.

    Raises OSError when nothing loadable is found there, ValueError when only a slow
    (Python) tokenizer exists: the incremental detokenizer needs the Rust decoder.
    """
    path = Path(path_or_name).expanduser()
    looks_local = path.is_absolute() or path_or_name.startswith((".", "~"))
    if looks_local and not path.exists():
        raise OSError(
            f"{path_or_name!r} does not exist; give an existing model directory or .gguf "
            "file, or a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
        )
    from transformers import AutoTokenizer

    try:
        if path.suffix == ".gguf" and path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                revision=revision,
                trust_remote_code=trust_remote_code,
            )
        else:
            tokenizer = AutoTokenizer.from_pretrained(
                path_or_name,
                revision=revision,
                use_fast=True,
                trust_remote_code=trust_remote_code,
            )
    except (OSError, ValueError) as e:
        # transformers raises ValueError for a directory with no tokenizer files.
        raise OSError(
            f"could not load a tokenizer from {path_or_name!r}: {e}\n"
            "Give a model directory containing tokenizer.json (or tokenizer_config.json), "
            "a .gguf file, or a Hugging Face hub id (with --tokenizer if it differs from "
            "the model)."
        ) from e
    if not tokenizer.is_fast:
        raise ValueError(
            f"the tokenizer of {path_or_name!r} has no fast (Rust) implementation; "
            "FlowEngine needs one. Convert it with transformers' convert_slow_tokenizer "
            "and save tokenizer.json next to the model."
        )
    return tokenizer


def encode(
    tokenizer: PreTrainedTokenizerBase, prompt: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of a completion prompt.

    add_special_tokens=True is Hugging Face's default: the tokenizer's post-processor
    adds what the model expects (for example BOS for Llama; nothing for SmolLM2).
    Raises TypeError if `prompt` is not a string.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}; pass text")
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def _generation_config_eos_ids(model_path: str, revision: str | None) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list), [] if there is none."""
    path = Path(model_path).expanduser()
    if path.suffix == ".gguf":
        return []  # the GGUF metadata already gave the tokenizer its EOS
    if path.is_dir():
        file = path / "generation_config.json"
        if not file.is_file():
            return []
        eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    else:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_path, revision=revision).eos_token_id
        except OSError:
            return []
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What the engine needs to know about a tokenizer, read once at start-up.

    eos_token_id: the id that ends a sequence (`NewRequest.eos_token_id`): the
    tokenizer's EOS, else the first EOS of generation_config.json, else None.
    eos_token_ids: every id that ends a sequence, the tokenizer's EOS first, then those
    of generation_config.json (Llama 3 Instruct lists several); the ones besides
    eos_token_id belong in a request's stop ids, as vLLM does.
    bos_token_id: or None. vocab_size: `len(tokenizer)`, added tokens included.
    """

    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids other than eos_token_id, to add to stop_token_ids."""
        return tuple(t for t in self.eos_token_ids if t != self.eos_token_id)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        model_path: str | None = None,
        revision: str | None = None,
    ) -> TokenizerInfo:
        """Read the ids from `tokenizer` and, when `model_path` is given, from its
        generation_config.json (a missing file is fine)."""
        ids: list[int] = []
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        if model_path is not None:
            ids.extend(_generation_config_eos_ids(model_path, revision))
        unique = tuple(dict.fromkeys(ids))
        return cls(
            eos_token_id=unique[0] if unique else None,
            eos_token_ids=unique,
            bos_token_id=tokenizer.bos_token_id,
            vocab_size=len(tokenizer),
        )
