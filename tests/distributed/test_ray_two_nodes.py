"""`--distributed-executor-backend ray` on a two-node Ray cluster on this machine.

scripts/ray_two_nodes.sh starts `ray start --head` and `ray start --address` in two
network namespaces joined by a veth pair (10.200.0.1 / 10.200.0.2), and runs this file
as a program in the head namespace: the default model with pipeline_parallel_size 2,
one stage on each node (STRICT_SPREAD), so the remote stage gets its plans and sends
its results over the driver's TCP channel and the hidden states cross the veth through
gloo. Greedy ids must equal one process; then the remote stage's Ray worker is killed
(SIGKILL) mid-stream and every request must still complete with the same ids.

Skips with the reason where Ray is not importable (CI without the `ray` extra), where
the `ray` executable is missing, or where `ip netns add` is not permitted (no root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "ray_two_nodes.sh")
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a village by the sea,", "1, 2, 3, 4, 5,"]
MAX_TOKENS = 16
ENGINE = dict(max_model_len=256, max_num_batched_tokens=32, enable_prefix_caching=True,
              enable_chunked_prefill=True)
# The remote stage's actor process: Ray names its worker after the running method.
ACTOR_TITLE = b"ray::RankWorker"
LOST_PLACEMENT_TIMEOUT_S = 20


def _greedy():
    from flowengine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _pids_in_other_netns(title: bytes = ACTOR_TITLE, netns: str | None = None) -> list[int]:
    """Pids whose command line starts with `title` in another network namespace than
    ours (the worker node's; the namespaces share the pid namespace), or in `netns`."""
    own = os.readlink("/proc/self/ns/net")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if not f.read().startswith(title):
                    continue
            ns = os.readlink(f"/proc/{entry}/ns/net")
            if (ns == netns) if netns else (ns != own):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _remote_actor_pids() -> list[int]:
    return _pids_in_other_netns()


def run_in_cluster(model: str, out_path: str) -> None:
    """The program the script runs in the head namespace: PP = 2 over the two nodes,
    once as is, once with the remote stage killed mid-stream, then with the worker
    node lost for good (every process of its namespace killed): the health check must
    fail and the driver must give up placing the group. Writes JSON, then exits at
    once (the lost node's request never finishes; the children exit with us)."""
    from flowengine import LLM

    os.environ["FLOWENGINE_RAY_PLACEMENT_STRATEGY"] = "STRICT_SPREAD"
    llm = LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    result: dict = {}
    try:
        engine = llm._background.engine
        first = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
        result["first"] = [list(o.outputs[0].token_ids) for o in first]
        result["remote_pids"] = _remote_actor_pids()
        remote_ns = os.readlink(f"/proc/{result['remote_pids'][0]}/ns/net")
        base = engine.get_stats().generation_tokens_total
        killed: list[int] = []

        def kill_mid_stream() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if engine.get_stats().generation_tokens_total >= base + 2 * len(PROMPTS):
                    for pid in _remote_actor_pids():
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_mid_stream, daemon=True)
        killer.start()
        second = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
        killer.join()
        result["killed"] = killed
        result["second"] = [list(o.outputs[0].token_ids) for o in second]
        result["restarts"] = engine.supervisor.num_restarts
        result["tokens_before_kill"] = base
        # The worker node never returns: the next driver cannot place the group.
        os.environ["FLOWENGINE_RAY_PLACEMENT_TIMEOUT_S"] = str(LOST_PLACEMENT_TIMEOUT_S)
        restarts = engine.supervisor.num_restarts
        t_lost = time.monotonic()
        for pid in _pids_in_other_netns(b"", remote_ns):
            os.kill(pid, signal.SIGKILL)
        threading.Thread(target=llm.generate, args=([PROMPTS[0]], _greedy()),
                         kwargs={"use_tqdm": False}, daemon=True).start()
        reason = None
        while time.monotonic() - t_lost < 300 and (
                reason is None or engine.supervisor.num_restarts < restarts + 2):
            reason = reason or engine.supervisor.unhealthy_reason()
            if reason and "unhealthy_after_s" not in result:
                result["unhealthy_after_s"] = time.monotonic() - t_lost
            time.sleep(0.2)
        result["unhealthy_reason"] = reason
        # One restart for the lost node, one more after a driver gave up placing.
        result["lost_node_restarts"] = engine.supervisor.num_restarts - restarts
        with open(out_path, "w") as f:
            json.dump(result, f)
    except BaseException:
        llm.shutdown()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _skip_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "Ray is not importable (pip install flowengine[ray])"
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        return "no `ray` executable next to this Python or on PATH"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) for network namespaces"
    name = f"fe-ray-probe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@pytest.mark.slow
def test_pp2_across_two_ray_nodes_equals_one_process_and_survives_a_killed_worker(
        default_model_path: str, tmp_path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from flowengine import LLM

    llm = LLM(default_model_path, **ENGINE)
    try:
        reference = [list(o.outputs[0].token_ids)
                     for o in llm.generate(PROMPTS, _greedy(), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert len({tuple(r) for r in reference}) == len(PROMPTS)
    out = tmp_path / "result.json"
    env = dict(os.environ, RAY=shutil.which("ray", path=os.path.dirname(sys.executable))
               or shutil.which("ray"),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [SCRIPT, "--", sys.executable, os.path.abspath(__file__), default_model_path,
         str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    # On failure: what the run saw, and the end of its log (the driver's errors).
    why = json.dumps({k: v for k, v in result.items() if k not in ("first", "second")}) \
        + "\n" + proc.stderr[-3000:]
    assert result["first"] == reference, why
    assert len(result["remote_pids"]) == 1, why  # stage 1 ran on the other node
    assert result["killed"] == result["remote_pids"], why
    assert result["second"] == reference, why
    assert result["restarts"] == 1, why
    # The lost node: /health fails (the restart counts as a stall) well within the
    # placement timeout plus the stall limit, and the driver says why it cannot start.
    assert (result["unhealthy_reason"] or "").startswith("restarting for "), why
    assert result.get("unhealthy_after_s", float("inf")) < LOST_PLACEMENT_TIMEOUT_S + 60, why
    assert result["lost_node_restarts"] >= 2, why
    assert (f"was not placed within {LOST_PLACEMENT_TIMEOUT_S} s "
            "(FLOWENGINE_RAY_PLACEMENT_TIMEOUT_S)") in proc.stderr, why


if __name__ == "__main__":
    run_in_cluster(sys.argv[1], sys.argv[2])
