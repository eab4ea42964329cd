"""Convert a GGUF file once into a Hugging Face directory in FlowEngine's cache.

The directory holds config.json, generation_config.json, float32 safetensors with
Hugging Face tensor names, and the tokenizer files transformers builds from the GGUF
vocabulary, so the engine, transformers and the tokenizer all load it as a normal
checkpoint. It is written into a temporary sibling directory and renamed into place:
a crash mid-conversion never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from flowengine.model.gguf_loader import gguf_hf_config, iter_gguf_tensors, open_gguf

# Bump when the output layout changes: older conversions are then redone.
CONVERTER_VERSION = 1
MARKER_FILE = "flowengine_conversion.json"
# Safetensors shard size: bounds the memory the conversion holds at once.
_SHARD_BYTES = 2 << 30


def conversion_source(out_dir: str) -> str | None:
    """The GGUF file `out_dir` was converted from, if this converter made it and the
    file still exists (for load_format="gguf" on a converted directory)."""
    marker = os.path.join(out_dir, MARKER_FILE)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        source = json.load(f).get("source_path")
    return source if source and os.path.isfile(source) else None


def is_converted(out_dir: str) -> bool:
    """True when `out_dir` is a complete conversion by this converter version."""
    marker = os.path.join(out_dir, MARKER_FILE)
    if not os.path.isfile(marker):
        return False
    with open(marker, encoding="utf-8") as f:
        return json.load(f).get("converter_version") == CONVERTER_VERSION


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Convert `gguf_path` into `out_dir` (created atomically) unless already done.

    Returns out_dir. Raises ValueError for an unsupported GGUF file; a concurrent
    conversion of the same file by another process is harmless (one rename wins).
    """
    if is_converted(out_dir):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.normpath(out_dir))
    _remove_abandoned_temp_dirs(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-{os.getpid()}-", dir=parent)
    try:
        _write_hf_dir(gguf_path, tmp)
        if os.path.isdir(out_dir):  # an outdated or broken earlier conversion
            shutil.rmtree(out_dir)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_converted(out_dir):  # not a concurrent converter that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_hf_dir(gguf_path: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    config.save_pretrained(out_dir)
    _write_generation_config(config, out_dir)
    _write_safetensors(iter_gguf_tensors(reader), out_dir)
    # transformers rebuilds a fast tokenizer (tokenizer.json + chat template) from the
    # GGUF vocabulary, merges and special-token ids.
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir)
    stat = os.stat(gguf_path)
    marker = {"converter_version": CONVERTER_VERSION, "source": os.path.basename(gguf_path),
              "source_path": os.path.abspath(gguf_path), "source_size_bytes": stat.st_size}
    with open(os.path.join(out_dir, MARKER_FILE), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2)


def _write_generation_config(config: Any, out_dir: str) -> None:
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)


def _write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str) -> None:
    """Write shards of at most _SHARD_BYTES (one in memory at a time): model.safetensors,
    or model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    files: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        file_name = f"shard-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        files.append((file_name, list(shard)))

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > _SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    flush()
    if len(files) == 1:
        os.rename(os.path.join(out_dir, files[0][0]), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map: dict[str, str] = {}
    for i, (file_name, names) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.rename(os.path.join(out_dir, file_name), os.path.join(out_dir, final))
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def _remove_abandoned_temp_dirs(parent: str, name: str) -> None:
    """Delete temp dirs of conversions of `name` whose process is gone (a crash)."""
    prefix = f".tmp-{name}-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        pid_text = entry[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    with contextlib.suppress(PermissionError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True
