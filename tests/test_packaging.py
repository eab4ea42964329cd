"""The wheel is complete: build it from a copy of the source tree, install it into a fresh
virtualenv, and use it from there, with the source tree out of reach.

CI otherwise only ever sees the editable install (`pip install -e`), which imports from
the source tree and so cannot notice a package missing from the wheel (issue #11: the
hand-written package list left out flowengine/distributed, and `LLM()` failed on import).

The virtualenv sees the system site-packages (torch, transformers, ... are not installed
twice), where the editable install of this repository also lives. Its Python runs with
`-I` from an empty folder, and every module's `__file__` is checked to lie in the
virtualenv, so nothing can be imported from the source tree by accident.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 6
PROMPT = "The capital of France is"

# Build outputs and caches that a clean clone does not have.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache",
    "*.so", ".venv",
)

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a clean copy of the source tree (no build/, no .so)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    # Without build isolation when the installed setuptools can build wheels itself
    # (>= 70.1 has bdist_wheel): no index needed, and faster. Else pip fetches the
    # [build-system] requirements, as `pip install .` does.
    no_isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
          *no_isolation, "-w", str(base / "dist"), str(src)], cwd=base)
    (wheel_path,) = (base / "dist").glob("flowengine-*.whl")
    return wheel_path


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=venv.parent)
    python = venv / "bin" / "python"
    # --force-reinstall: pip would otherwise take the editable install it sees in the
    # system site-packages as this very version, and install nothing.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall",
          "--disable-pip-version-check", str(wheel)], cwd=venv.parent)
    (site,) = venv.glob("lib/python*/site-packages")
    assert (site / "flowengine" / "__init__.py").is_file()
    return python


def _source_files() -> set[str]:
    """Paths every wheel must hold, as installed: flowengine/**.py and kernels/**.py
    (as flowengine/kernels/**.py), and the fused-MoE tile configs kernels/configs/*.json
    (without them an installed engine silently runs the default tiles)."""
    files = set()
    for path in (ROOT / "flowengine").rglob("*.py"):
        files.add(path.relative_to(ROOT).as_posix())
    kernels = ROOT / "kernels"
    for path in [*kernels.rglob("*.py"), *(kernels / "configs").glob("*.json")]:
        files.add("flowengine/kernels/" + path.relative_to(kernels).as_posix())
    return files


def test_wheel_holds_every_source_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert missing == []
    assert "flowengine/py.typed" in names
    assert any(n.startswith("flowengine/shm/_ring.") and n.endswith(".so") for n in names)
    # Nothing of the repository but the package: no tests, no top-level kernels.
    assert sorted({n.split("/")[0] for n in names}) == [
        "flowengine", f"flowengine-{_version()}.dist-info"
    ]


def _version() -> str:
    from flowengine.version import __version__

    return __version__


_IN_VENV = textwrap.dedent(
    """
    import importlib, importlib.metadata, json, os, pkgutil, sys
    # The editable install of the source tree (in the system site-packages) adds a
    # finder that would serve any flowengine module the wheel lacks: drop it.
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    import flowengine
    site = os.path.dirname(os.path.dirname(flowengine.__file__))
    modules, outside = [], []
    for info in pkgutil.walk_packages(flowengine.__path__, "flowengine."):
        mod = importlib.import_module(info.name)
        modules.append(info.name)
        if not os.path.abspath(mod.__file__).startswith(site + os.sep):
            outside.append((info.name, mod.__file__))
    from flowengine import LLM, AsyncEngine, SamplingParams
    llm = LLM(max_model_len=256, num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if name.startswith("flowengine") and file and not file.startswith(site + os.sep):
            outside.append((name, file))
    print(json.dumps({
        "site": site,
        "prefix": sys.prefix,
        "version": flowengine.__version__,
        "dist_version": importlib.metadata.version("flowengine"),
        "all": sorted(flowengine.__all__),
        "modules": modules,
        "outside": outside,
        "prompt_token_ids": out.prompt_token_ids,
        "token_ids": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
    }))
    """
).replace("PROMPT", repr(PROMPT)).replace("MAX_TOKENS", str(MAX_TOKENS))


def test_installed_wheel_imports_every_module_and_generates(
    venv_python: Path, tmp_path: Path, hf_model, hf_greedy
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run(
        [str(venv_python), "-I", "-c", _IN_VENV], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    venv = venv_python.parent.parent
    assert got["prefix"] == str(venv)
    assert got["site"].startswith(str(venv) + os.sep)
    assert got["outside"] == []
    expected_modules = {
        p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for p in _source_files() if p.endswith(".py")
    } - {"flowengine"}
    # C extensions (setup.py builds one module per source file).
    expected_modules |= {
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for p in (ROOT / "flowengine").rglob("*.c")
    }
    assert sorted(got["modules"]) == sorted(expected_modules)
    assert got["version"] == got["dist_version"] == _version()
    assert {"LLM", "AsyncEngine", "SamplingParams", "__version__"} <= set(got["all"])
    # The installed engine answers exactly what Hugging Face transformers answers.
    expected = hf_greedy(hf_model, got["prompt_token_ids"], MAX_TOKENS)
    assert got["token_ids"] == expected
    assert got["text"]


def test_console_script_version(venv_python: Path, tmp_path: Path) -> None:
    script = venv_python.parent / "flowengine"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run([str(script), "--version"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"flowengine {_version()}"
