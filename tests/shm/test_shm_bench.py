"""`flowengine bench ring` runs end to end (tiny counts; no timing is asserted)."""

from __future__ import annotations

import pytest

from flowengine.bench.ring import main


def test_bench_ring_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sizes", "64,2048", "--count", "300", "--latency-count", "20", "--idle-count", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("command: flowengine bench ring --sizes 64,2048 --count 300")
    rows = [line for line in out.splitlines() if line.startswith("| 64 B") or "| 2 KiB" in line]
    assert [row.split("|")[2].strip() for row in rows] == ["ring", "zmq", "queue"] * 2
    assert "ring/zmq throughput" in out


def test_bench_ring_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--sizes", "4"])
    with pytest.raises(SystemExit):
        main(["--transports", "carrier_pigeon"])


def test_bench_ring_without_pyzmq_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "zmq" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit):
        main(["--count", "10"])
    assert "pyzmq is not installed" in capsys.readouterr().err
