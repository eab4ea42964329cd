"""The committed gRPC stubs are what grpcio-tools generates from the .proto today."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from flowengine.entrypoints.grpc import codegen  # noqa: E402


def test_committed_stubs_equal_a_fresh_codegen(tmp_path):
    written = codegen.generate(tmp_path)
    assert [p.name for p in written] == list(codegen.STUBS)
    committed = Path(codegen.__file__).parent
    for path in written:
        assert path.read_text() == (committed / path.name).read_text(), (
            f"{path.name} is stale: run python -m flowengine.entrypoints.grpc.codegen")
    # The stubs import each other through the package, not protoc's flowengine.v1.
    assert "from flowengine.entrypoints.grpc import generate_pb2" in (
        committed / "generate_pb2_grpc.py").read_text()
