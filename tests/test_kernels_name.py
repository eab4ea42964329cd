"""The top-level kernels/ folder (flowengine.kernels) does not shadow PyPI's `kernels`.

Run from the repository root, `python -m ...` puts the root on sys.path, where kernels/
is importable as `kernels`, the name of the package transformers (>= 5.25) imports at
start-up. kernels/__init__.py hands such an import to the installed package
(transformers then imports), or stays an empty module without `__version__` when none is
installed (transformers 5.17 imports the name and reads "N/A" as not available).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_in_root(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_top_level_kernels_import_is_not_flowengines_folder() -> None:
    out = _run_in_root(
        "import sys, kernels; print(kernels.__file__); "
        "print(getattr(kernels, '__version__', 'N/A')); print(sys.path[0] in ('', '.'))")
    path, version, root_first = out.splitlines()
    assert root_first == "True"  # the root really is on sys.path, ahead of site-packages
    try:
        installed = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is None:
        assert Path(path) == ROOT / "kernels" / "__init__.py" and version == "N/A"
    else:
        assert Path(path).parent != ROOT / "kernels"
        assert version == installed


def test_transformers_and_flowengine_kernels_import_from_the_root() -> None:
    out = _run_in_root(
        "from transformers import LlamaConfig; import flowengine.kernels.rotary as r; "
        "print(LlamaConfig.model_type, r.__name__)")
    assert out == "llama flowengine.kernels.rotary"


def test_two_checkouts_on_the_path_do_not_hand_the_import_back_and_forth(tmp_path) -> None:
    """A second checkout's kernels/ on PYTHONPATH (e.g. an old worktree for an A/B run
    from the repository root): each shim used to hand the import to the other until
    Python's recursion limit, which transformers reported as "Could not import module
    'LlamaConfig'"."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text((ROOT / "kernels" / "__init__.py").read_text())
    code = ("import kernels; from transformers import LlamaConfig; "
            "print(LlamaConfig.model_type, getattr(kernels, '__version__', 'N/A'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_type, version = proc.stdout.split()
    assert model_type == "llama"
    try:
        assert version == importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert version == "N/A"
