"""A model that cannot be downloaded (no network, a typo'd hub id) is one clear error
line from `flowengine serve` and `flowengine generate`, not a RuntimeError traceback."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator

import huggingface_hub
import pytest

from flowengine.entrypoints.cli import main

MESSAGE = "could not download org/model from the hub (network unreachable?)"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def snapshot_download(**kwargs: object) -> str:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    sigint = signal.getsignal(signal.SIGINT)  # `serve` resets it before loading
    yield
    signal.signal(signal.SIGINT, sigint)


def test_serve_names_the_model_it_could_not_download(caplog, capsys) -> None:
    with caplog.at_level(logging.ERROR, logger="flowengine.entrypoints.openai.server"):
        assert main(["serve", "org/model", "--port", "0"]) == 1
    [record] = caplog.records
    assert record.getMessage().startswith(f"cannot start the engine: {MESSAGE}")
    assert "Traceback" not in capsys.readouterr().err


def test_generate_names_the_model_it_could_not_download(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "org/model", "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flowengine generate: error: {MESSAGE}") and "Traceback" not in err
