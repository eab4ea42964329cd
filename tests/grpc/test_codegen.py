"""The committed gRPC stubs are what grpcio-tools generates from the .proto today, up to
the tool's version stamps: a grpcio-tools patch release (1.85.1 -> 1.85.4) rewrote
`GRPC_GENERATED_VERSION` and nothing else, which is not a stale stub."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from flowengine.entrypoints.grpc import codegen  # noqa: E402


def _unstamped(text: str) -> str:
    """The stub with the generating tools' versions blanked: grpcio-tools' stamp and
    protobuf's version comment and runtime check."""
    text = re.sub(r"^GRPC_GENERATED_VERSION = '[^']*'$", "GRPC_GENERATED_VERSION = <v>", text,
                  flags=re.M)
    text = re.sub(r"^# Protobuf Python Version: .*$", "# Protobuf Python Version: <v>", text,
                  flags=re.M)
    return re.sub(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
                  r"\s*\d+,\s*\d+,\s*\d+,", r"\1 <v>,", text)


def test_version_stamps_are_all_that_is_blanked():
    stub = ("GRPC_GENERATED_VERSION = '1.85.4'\nx = 1\n# Protobuf Python Version: 7.36.2\n"
            "_runtime_version.ValidateProtobufRuntimeVersion(\n"
            "    _runtime_version.Domain.PUBLIC,\n    7,\n    36,\n    2,\n    '',\n)\n")
    other = stub.replace("1.85.4", "1.85.1").replace("7.36.2", "7.35.1").replace(
        "    36,\n    2,", "    35,\n    1,")
    assert _unstamped(stub) == _unstamped(other)
    assert _unstamped(stub) != _unstamped(stub.replace("x = 1", "x = 2"))


def test_committed_stubs_equal_a_fresh_codegen(tmp_path):
    written = codegen.generate(tmp_path)
    assert [p.name for p in written] == list(codegen.STUBS)
    committed = Path(codegen.__file__).parent
    for path in written:
        assert _unstamped(path.read_text()) == _unstamped((committed / path.name).read_text()), (
            f"{path.name} is stale: run python -m flowengine.entrypoints.grpc.codegen")
    # The stubs import each other through the package, not protoc's flowengine.v1.
    assert "from flowengine.entrypoints.grpc import generate_pb2" in (
        committed / "generate_pb2_grpc.py").read_text()
