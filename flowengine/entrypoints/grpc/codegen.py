"""Generate the Python stubs of proto/flowengine/v1/generate.proto (grpcio-tools).

    python -m flowengine.entrypoints.grpc.codegen          # rewrite the committed stubs
    python -m flowengine.entrypoints.grpc.codegen OUT_DIR  # write them elsewhere

The stubs are committed (so serving needs grpcio and protobuf only, not grpcio-tools);
tests/grpc/test_codegen.py regenerates them and compares. protoc names the stub modules
after the proto's path (`flowengine.v1.generate_pb2`); `generate()` rewrites that import
to the package the stubs live in and marks the files exempt from ruff.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO / "proto"
PROTO = "flowengine/v1/generate.proto"
PACKAGE = "flowengine.entrypoints.grpc"
STUBS = ("generate_pb2.py", "generate_pb2_grpc.py", "generate_pb2.pyi")


def generate(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the stubs into `out_dir`; returns their paths. Raises RuntimeError if protoc
    fails, ImportError without grpcio-tools."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        written = []
        for name in STUBS:
            text = (Path(tmp) / "flowengine" / "v1" / name).read_text()
            text = text.replace("from flowengine.v1 import generate_pb2",
                                f"from {PACKAGE} import generate_pb2")
            text = "# ruff: noqa\n" + text  # generated code: not held to the lint rules
            path = out_dir / name
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent)
    for p in generate(target):
        print(p)
