"""A flag whose extra is not installed (--distributed-executor-backend ray without
Ray) is one clear error line from `flowengine serve` and `flowengine generate`, not an
ImportError traceback; so is `flowengine bench serve` without the 'bench' extra."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from flowengine.entrypoints.cli import main

needs_no_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is not None,
                                  reason="Ray is installed")
MESSAGE = "distributed_executor_backend 'ray' needs Ray"


@needs_no_ray
def test_serve_names_the_missing_extra(caplog, capsys) -> None:
    with caplog.at_level(logging.ERROR, logger="flowengine.entrypoints.openai.server"):
        assert main(["serve", "--distributed-executor-backend", "ray", "--port", "0"]) == 2
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [MESSAGE]
    assert "Traceback" not in capsys.readouterr().err


@needs_no_ray
def test_generate_names_the_missing_extra(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--distributed-executor-backend", "ray", "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flowengine generate: error: {MESSAGE}") and "Traceback" not in err


def test_bench_serve_names_the_missing_extra(monkeypatch, capsys) -> None:
    # Without httpx (a fresh `pip install .`), even `bench serve --help` was a traceback.
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx raises ImportError
    monkeypatch.delitem(sys.modules, "flowengine.bench.serve", raising=False)
    assert main(["bench", "serve", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowengine bench serve: error: ") and "httpx" in err
    assert err.rstrip().endswith("pip install 'flowengine[bench]'") and "Traceback" not in err
