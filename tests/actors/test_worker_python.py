"""Engine and executor processes import the same flowengine as the process that starts
them, whatever the working directory holds (supervisor.worker_python): a clone's root
beside a `pip install .` has the source tree without the compiled extensions, and
`python -m` would put it first on the child's sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flowengine
from flowengine.actors.supervisor import worker_python

ROOT = Path(flowengine.__file__).resolve().parents[1]


def _child_flowengine(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    # The worker's interpreter and flags, with a probe instead of `-m flowengine...`.
    python = cmd[:cmd.index("-m")]
    proc = subprocess.run([*python, "-c", "import flowengine; print(flowengine.__file__)"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_decoy_source_tree_in_the_working_directory_is_not_imported(tmp_path, monkeypatch):
    decoy = tmp_path / "flowengine"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy source tree')\n")
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ)
    cmd = worker_python(env)
    assert cmd[:2] == [sys.executable, "-P"] and cmd[-2:] == ["-m", "flowengine.actors.procs"]
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")  # nothing added
    assert Path(_child_flowengine(cmd, env, tmp_path)).resolve() == Path(flowengine.__file__).resolve()


def test_a_tree_imported_from_the_working_directory_stays_on_the_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = dict(os.environ)
    cmd = worker_python(env)
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/elsewhere"])
    assert Path(_child_flowengine(cmd, env, ROOT)).resolve() == Path(flowengine.__file__).resolve()
