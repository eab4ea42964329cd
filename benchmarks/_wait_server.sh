# Sourced by benchmarks/issue14_gpu.sh, served_gpu.sh and frontend_cpu.sh (not run by itself).
#
# wait_server PORT [PID] [SECONDS]: poll http://127.0.0.1:PORT/health every 0.25 s until
# it answers (return 0), the server process PID exits (return 1, "server exited"), or
# SECONDS pass (default 100; return 1, "server did not come up"). On failure the caller
# tails its server log and kills the server.
#
# cpu_s PID: "pid:seconds" (user + system CPU) of PID and each process below it.
#
# wait_running PORT [SECONDS]: poll PORT/metrics until num_requests_running > 0 (the
# clients first build their prompts), so that a profiler attaches to steady serving.
wait_server() {
    python3 - "$1" "${2:-}" "${3:-100}" <<'PY'
import os, sys, time, urllib.request
port, pid, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    if pid:
        try:
            os.kill(int(pid), 0)
        except OSError:
            sys.exit("server exited")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.25)
sys.exit("server did not come up")
PY
}

wait_running() {
    python3 - "$1" "${2:-75}" <<'PY'
import re, sys, time, urllib.request
port, limit = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    except Exception:
        body = ""
    m = re.search(r"^\S*num_requests_running\S* ([0-9.e+]+)$", body, re.M)
    if m and float(m.group(1)) > 0:
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
PY
}

# stop_server PID [SECONDS]: SIGINT (the server logs its executor timers at shutdown), wait
# up to SECONDS (default 20) for it to exit, then SIGKILL: a stuck shutdown cannot hang the
# script and eat the rest of a device call.
stop_server() {
    local pid=$1 limit=${2:-20} i
    kill -INT "$pid" 2>/dev/null || return 0
    for ((i = 0; i < limit * 4; i++)); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
        sleep 0.25
    done
    echo "server $pid still up ${limit}s after SIGINT: SIGKILL"
    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}

# metrics_line PORT WHAT: one line from the server's /metrics (cumulative since start).
#   WHAT=prefix: "prefix cache: H of Q prompt tokens hit (P%)", so a run's prompts can be
#     seen to be distinct;
#   WHAT=ttft: the server's own view of where a request's time to first token goes
#     (means): waiting in the engine's queue, from scheduled to first token (prefill),
#     and the whole server-side TTFT, which starts when the request reaches the engine
#     client (`submit`). Set against the client's TTFT, the rest is spent before
#     `submit`: the connection, HTTP, the frontend's event loop.
metrics_line() {
    python3 - "$1" "$2" <<'PY'
import re, sys, urllib.request
port, what = sys.argv[1], sys.argv[2]
try:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
except Exception as exc:
    sys.exit(f"{what}: /metrics unreadable ({exc})")
def total(name):
    return sum(float(v) for v in re.findall(rf"^\S*{name}\S* ([0-9.e+]+)$", body, re.M))
def mean_ms(name):
    n = total(f"{name}_count")
    return 1000 * total(f"{name}_sum") / n if n else float("nan")
if what == "prefix":
    q, h = total("prefix_cache_queries_total"), total("prefix_cache_hits_total")
    print(f"prefix cache: {h:.0f} of {q:.0f} prompt tokens hit ({100 * h / max(q, 1):.1f}%)")
else:
    print("server-side means (ms, since start): queue {:.1f}, prefill {:.1f}, TTFT {:.1f}"
          .format(mean_ms("request_queue_time_seconds"), mean_ms("request_prefill_time_seconds"),
                  mean_ms("time_to_first_token_seconds")))
PY
}
prefix_hits() { metrics_line "$1" prefix; }
ttft_split() { metrics_line "$1" ttft; }

cpu_s() {  # CPU seconds (user + system) of a pid and its children processes
  python3 - "$@" <<'PYCPU'
import os, sys
tick = os.sysconf("SC_CLK_TCK")
def procs(root):
    out = [root]
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == root:
                    out += procs(int(p))
            except OSError:
                pass
    return out
res = []
for pid in procs(int(sys.argv[1])):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        res.append(f"{pid}:{(int(f[11]) + int(f[12])) / tick:.2f}")
    except OSError:
        pass
print(" ".join(res))
PYCPU
}
