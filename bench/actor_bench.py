"""Actor-runtime benchmark: monarch-tensor against PyTorch Monarch, Ray and raw zmq.

    python bench/actor_bench.py                                 # ours + zmq floors
    python bench/actor_bench.py --peers --json bench/out/actor_bench.json
    python bench/actor_bench.py --tiny --json /tmp/tiny.json    # smoke test, every workload tiny (~10 s)

Workloads (targets in shared/notes/figures.md), on procs of this machine, one echo actor per proc:
  rtt          sync ``call_one`` round trip of a small int (median over N_RTT calls, median of REPEATS)
  pipelined    N_PIPE ``call_one`` in flight, then wait for all (calls/s)
  *_cpu_us     CPU time per pipelined call (all threads, user + system), in the calling process and
               in the actor's proc: what a message costs, a figure a busy machine disturbs less than
               the wall-clock ones
  call_both    ``call()`` to both procs of a 2-proc mesh, wait for both (µs)
  echo         a numpy array of ARRAY_MIB there and back; GiB/s counts both directions (2 x size / time)
  spawn        from a fresh process with the library imported: spawn 2 procs + actors, first reply of
               both (s); then until both procs have imported torch (our procs fork from a template
               that already has it); import of the library itself is its own row
  bcast_N      ``call()`` + wait on a mesh of N procs, for N in MESH_SIZES (µs)
Floors (plain pyzmq over ipc:// between two processes): REQ/REP round trip of 8 bytes, DEALER/ROUTER
with N_PIPE messages in flight, REQ/REP echo of the same array with copy=False. Under the table, the
kernel's floor of a round trip: 8 bytes there and back on a blocking Unix socket between two processes
(no library, no I/O thread: two thread wake-ups a round trip, zmq's take six), and what ours takes over it,
in µs and as a ratio; on a loaded machine, what it adds to each wake-up shows there.

Every runtime runs in its own fresh subprocess (RUNS times, interleaved so drift hits all alike); the
table shows the median over runs and ratios "how many times better ours is" (>1: ours better; for
the floors, the fraction of the floor we reach). Absolute numbers drift between machines: compare
only ratios measured in one run. --json PATH writes settings, medians and every run's raw numbers.

Peers are optional and never dependencies of monarch-tensor: `pip install torchmonarch ray`
(Monarch is imported as `monarch`). A peer that is missing or fails shows up in the table as
"not installed" or "error" (full message under the table) and the bench still finishes.
torchmonarch 0.7.0 needs cloudpickle>=3; to keep it out of the project's environment, install
it aside and point MT_BENCH_PEER_PATH at it (it is put on PYTHONPATH for the peers only); torch and
numpy come from this environment, the rest of torchmonarch's dependencies go aside with it:
    pip install --no-deps --target bench/out/peer-site torchmonarch==0.7.0 cloudpickle==3.1.2
    pip install --target bench/out/peer-site opentelemetry-api pyre-extensions lark tabulate clusterscope \
        xxhash pyarrow flask requests typing-extensions
    MT_BENCH_PEER_PATH=bench/out/peer-site python bench/actor_bench.py --peers --json bench/out/actor_bench.json
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from _runs import add_common_args, apply_common_args, interleaved, launch  # bench/ is on sys.path

# ---- settings ------------------------------------------------------------------------------
RUNS = 5             # fresh-process runs per runtime; the table shows their median
N_RTT = 500          # sync calls per repeat
REPEATS = 5          # repeats of the latency and throughput loops (median of them)
WARMUP = 50          # untimed calls before each timed loop
N_PIPE = 2000        # calls in flight
N_BOTH = 300         # call() to both procs, per repeat
ARRAY_MIB = 64       # echoed array
N_ECHO = 5           # echoes of the array (after one warm-up)
MESH_SIZES = [1, 2, 4, 8, 16]
N_BCAST = 100        # call()s per mesh size
TIMEOUT = 60.0       # every wait on a reply, in seconds
RUN_TIMEOUT = 600.0  # one runtime's whole run (a fresh subprocess), in seconds
TINY = dict(RUNS=1, N_RTT=20, REPEATS=2, WARMUP=3, N_PIPE=50, N_BOTH=10, ARRAY_MIB=1, N_ECHO=2,
            MESH_SIZES=[1, 2], N_BCAST=5, RUN_TIMEOUT=90.0)
SETTINGS = ["RUNS", "N_RTT", "REPEATS", "WARMUP", "N_PIPE", "N_BOTH", "ARRAY_MIB", "N_ECHO", "MESH_SIZES",
            "N_BCAST", "TIMEOUT", "RUN_TIMEOUT"]
PEER_PATH = os.environ.get("MT_BENCH_PEER_PATH", "")
MARKER = "ACTOR_BENCH_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNTIMES = {"ours": "monarch-tensor", "monarch": "Monarch", "ray": "Ray", "floor": "zmq floor"}


def workloads():
    """(key, label, unit, higher_is_better, floor key) for every row of the table."""
    rows = [
        ("rtt_us", "sync call_one round trip, small int", "µs", False, "zmq_reqrep_us"),
        ("pipelined_per_s", f"pipelined call_one, {N_PIPE} in flight", "/s", True, "zmq_pipelined_per_s"),
        ("pipe_ctl_cpu_us", "  ... CPU per call, calling process", "µs", False, "zmq_pipe_ctl_cpu_us"),
        ("pipe_proc_cpu_us", "  ... CPU per call, actor's proc", "µs", False, "zmq_pipe_proc_cpu_us"),
        ("call_both_us", "call() to both procs, wait for both", "µs", False, None),
        ("echo_gib_s", f"echo of a {ARRAY_MIB} MiB numpy array (both ways)", "GiB/s", True, "zmq_echo_gib_s"),
        ("spawn_s", "spawn 2 procs + actors + first reply", "s", False, None),
        ("spawn_torch_s", "  ... until torch imported in both procs", "s", False, None),
        ("import_s", "import of the library", "s", False, None),
    ]
    rows += [(f"bcast_{n}_us", f"call() + wait, mesh of {n} proc{'s' * (n > 1)}", "µs", False, None)
             for n in MESH_SIZES]
    return rows


# ---- measuring (runs in the worker subprocess) ---------------------------------------------
def lat_us(fn, n):
    """Median over REPEATS of the median µs of n calls of fn()."""
    for _ in range(WARMUP):
        fn()
    meds = []
    for _ in range(REPEATS):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        meds.append(statistics.median(ts) * 1e6)
    return statistics.median(meds)


def cpu_s(pid=None):
    """CPU seconds (user + system, all threads) of process ``pid``, or of this one."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pipelined(send, recv, n, pid):
    """REPEATS loops of ``n`` ``send(i)`` then ``n`` ``recv()`` (which must give back 0..n-1): the median
    rate (/s) and the CPU µs per message in this process and in process ``pid`` over all loops."""
    rates, cpu0, peer0 = [], cpu_s(), cpu_s(pid)
    for _ in range(REPEATS):
        t = time.perf_counter()
        pending = [send(i) for i in range(n)]
        got = [recv(p) for p in pending]
        rates.append(n / (time.perf_counter() - t))
        assert got == list(range(n)), "replies differ from the calls"
    calls = n * REPEATS
    return statistics.median(rates), (cpu_s() - cpu0) / calls * 1e6, (cpu_s(pid) - peer0) / calls * 1e6


class MonarchAPI:
    """Ours and PyTorch Monarch: the same code, only the import differs."""

    def __init__(self, module):
        t = time.perf_counter()
        mod = __import__(module, fromlist=["Actor"])
        self.import_s = time.perf_counter() - t
        self.this_host = mod.this_host

        class Echo(mod.Actor):
            @mod.endpoint
            def echo(self, x):
                return x

            @mod.endpoint
            def torch_version(self):
                import torch
                return str(torch.__version__)  # TorchVersion would make the client import torch

            @mod.endpoint
            def pid(self):
                return os.getpid()

        self.Echo = Echo

    def start(self):
        pass

    def spawn(self, n, name):
        procs = self.this_host().spawn_procs(per_host={"gpus": n})
        return procs, procs.spawn(name, self.Echo)

    def one(self, h, rank):
        return h[1].slice(gpus=rank).echo

    def call_one(self, ep, x):
        return ep.call_one(x)

    def get(self, fut):
        return fut.get(timeout=TIMEOUT)

    def call_all(self, h, method="echo", *args):
        return list(getattr(h[1], method).call(*args).get(timeout=TIMEOUT).values())

    def stop(self, h):
        h[0].stop().get(timeout=TIMEOUT)

    def shutdown(self):
        pass


class RayAPI:
    def __init__(self):
        t = time.perf_counter()
        import ray
        self.import_s = time.perf_counter() - t
        self.ray = ray

        @ray.remote(num_cpus=0)  # a mesh of 16 actors must fit on 2 CPUs
        class Echo:
            def echo(self, x):
                return x

            def torch_version(self):
                import torch
                return str(torch.__version__)  # TorchVersion would make the client import torch

            def pid(self):
                return os.getpid()

        self.Echo = Echo

    def start(self):  # the local cluster is Ray's counterpart of our template process
        self.ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    def spawn(self, n, name):
        return [self.Echo.remote() for _ in range(n)]

    def one(self, h, rank):
        return h[rank]

    def call_one(self, actor, x):
        return actor.echo.remote(x)

    def get(self, ref):
        return self.ray.get(ref, timeout=TIMEOUT)

    def call_all(self, h, method="echo", *args):
        return self.ray.get([getattr(a, method).remote(*args) for a in h], timeout=TIMEOUT)

    def stop(self, h):
        for a in h:
            self.ray.kill(a)

    def shutdown(self):
        self.ray.shutdown()


def measure(rt, res):
    """Run every workload on runtime adapter ``rt``, filling ``res`` as it goes."""
    import numpy as np

    res["import_s"] = rt.import_s
    t = time.perf_counter()
    rt.start()
    h = rt.spawn(2, "echo")
    assert rt.call_all(h, "echo", 7) == [7, 7]
    res["spawn_s"] = time.perf_counter() - t
    versions = rt.call_all(h, "torch_version")
    res["spawn_torch_s"] = time.perf_counter() - t
    assert all(versions), versions
    try:
        ep = rt.one(h, 0)
        res["rtt_us"] = lat_us(lambda: rt.get(rt.call_one(ep, 1)), N_RTT)

        pid = rt.call_all(h, "pid")[0]
        res["pipelined_per_s"], res["pipe_ctl_cpu_us"], res["pipe_proc_cpu_us"] = pipelined(
            lambda i: rt.call_one(ep, i), rt.get, N_PIPE, pid)

        res["call_both_us"] = lat_us(lambda: rt.call_all(h, "echo", 1), N_BOTH)

        arr = np.arange(ARRAY_MIB * 2**20 // 8, dtype=np.int64)
        rt.get(rt.call_one(ep, arr))
        rates = []
        for _ in range(N_ECHO):
            t = time.perf_counter()
            out = rt.get(rt.call_one(ep, arr))
            rates.append(2 * arr.nbytes / (time.perf_counter() - t) / 2**30)
            assert out.shape == arr.shape and out[-1] == arr[-1], "echoed array differs"
            del out
        res["echo_gib_s"] = statistics.median(rates)
    finally:
        rt.stop(h)

    for n in MESH_SIZES:
        m = rt.spawn(n, f"bcast{n}")
        try:
            assert rt.call_all(m, "echo", 1) == [1] * n
            res[f"bcast_{n}_us"] = lat_us(lambda m=m: rt.call_all(m, "echo", 1), N_BCAST)
        finally:
            rt.stop(m)


def zmq_server(kind, addr):
    """Floor peer: echo every message back (REP or ROUTER), zero-copy."""
    import zmq
    sock = zmq.Context().socket(zmq.REP if kind == "rep" else zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(addr)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def socket_server(sock):
    """Kernel floor peer: echo every 8 bytes back on a blocking Unix socket."""
    import socket

    while True:
        data = sock.recv(8, socket.MSG_WAITALL)
        if len(data) < 8:  # (the other end closed)
            return
        sock.sendall(data)


def measure_socket_floor(res):
    import multiprocessing
    import socket

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = multiprocessing.get_context("fork").Process(target=socket_server, args=(theirs,), daemon=True)
    server.start()
    theirs.close()
    mine.settimeout(TIMEOUT)
    try:
        def rr(msg=b"12345678"):
            mine.sendall(msg)
            if mine.recv(8, socket.MSG_WAITALL) != msg:
                raise RuntimeError("the socket floor's peer answered something else")
        res["unix_rtt_us"] = lat_us(rr, N_RTT)
    finally:
        mine.close()
        server.kill()  # (its copy of ``mine``, from the fork, keeps its end open)
        server.join(TIMEOUT)


def measure_floor(res):
    import multiprocessing

    import numpy as np
    import zmq
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="actor-bench-")
    measure_socket_floor(res)
    for kind in ("rep", "router"):
        addr = f"ipc://{tmp}/{kind}"
        server = multiprocessing.get_context("fork").Process(target=zmq_server, args=(kind, addr), daemon=True)
        server.start()
        sock = ctx.socket(zmq.REQ if kind == "rep" else zmq.DEALER)
        for opt, v in ((zmq.RCVTIMEO, int(TIMEOUT * 1000)), (zmq.SNDTIMEO, int(TIMEOUT * 1000)),
                       (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
            sock.setsockopt(opt, v)
        sock.connect(addr)
        try:
            if kind == "rep":
                def rr(msg=b"12345678", sock=sock):
                    sock.send(msg)
                    return sock.recv()
                res["zmq_reqrep_us"] = lat_us(rr, N_RTT)

                arr = np.arange(ARRAY_MIB * 2**20 // 8, dtype=np.int64)
                rates = []
                for _ in range(N_ECHO + 1):
                    t = time.perf_counter()
                    sock.send(arr, copy=False)
                    out = np.frombuffer(sock.recv(copy=False).buffer, dtype=np.int64)
                    rates.append(2 * arr.nbytes / (time.perf_counter() - t) / 2**30)
                    assert out[-1] == arr[-1]
                res["zmq_echo_gib_s"] = statistics.median(rates[1:])
            else:
                def send(i, sock=sock):
                    sock.send(i.to_bytes(8, "little"))

                def recv(_, sock=sock):
                    return int.from_bytes(sock.recv(), "little")

                pipelined(send, recv, N_PIPE, server.pid)  # warm-up
                (res["zmq_pipelined_per_s"], res["zmq_pipe_ctl_cpu_us"],
                 res["zmq_pipe_proc_cpu_us"]) = pipelined(send, recv, N_PIPE, server.pid)
        finally:
            sock.close()
            server.kill()
            server.join(TIMEOUT)


def worker(kind):
    """Body of one fresh subprocess: measure one runtime, print the results as one JSON line."""
    res = {}
    try:
        if kind == "floor":
            measure_floor(res)
        else:
            try:
                rt = {"ours": lambda: MonarchAPI("monarch_tensor.actor"), "monarch": lambda: MonarchAPI("monarch.actor"),
                      "ray": RayAPI}[kind]()
            except ImportError as e:
                res["error"] = f"not installed ({e})"
                return
            try:
                measure(rt, res)
            finally:
                rt.shutdown()
    except BaseException as e:  # noqa: BLE001 - reported in the table
        res["error"] = f"{type(e).__name__}: {e}"
        if kind == "monarch" and "cloudpickle" in str(e):
            res["error"] = "torchmonarch needs cloudpickle>=3 (see MT_BENCH_PEER_PATH in the docstring): " + res["error"]
    finally:
        print(MARKER + json.dumps(res), flush=True)


# ---- orchestration (the parent process) -----------------------------------------------------
def run_once(kind, settings):
    """One fresh subprocess for ``kind``; returns its result dict (with "error" on failure)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    if kind in ("monarch", "ray") and PEER_PATH:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(PEER_PATH), env["PYTHONPATH"]])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--settings", json.dumps(settings)]
    return launch(cmd, env, MARKER, RUN_TIMEOUT, ROOT)


def fmt(v, unit):
    if v is None:
        return "-"
    if unit == "µs":
        return f"{v:,.1f} µs" if v < 100 else f"{v:,.0f} µs"
    if unit == "/s":
        return f"{v:,.0f} /s"
    return f"{v:.2f} {unit}"


def ratio(ours, other, higher):
    if not ours or not other:
        return "-"
    return f"{(ours / other if higher else other / ours):.2f}x"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", action="store_true", help="also run PyTorch Monarch and Ray when importable")
    add_common_args(ap, RUNS, RUNTIMES)
    args = ap.parse_args()
    g = globals()
    apply_common_args(args, g)
    if args.worker:
        worker(args.worker)
        return

    settings = {k: g[k] for k in SETTINGS}
    kinds = ["ours", "floor"] + (["monarch", "ray"] if args.peers else [])
    t0 = time.perf_counter()
    runs, errors = interleaved(kinds, RUNS, run_once, RUNTIMES, settings)

    rows = workloads()
    med = {}
    for kind in kinds:
        keys = {k for r in runs[kind] for k, v in r.items() if isinstance(v, (int, float))}
        med[kind] = {k: statistics.median([r[k] for r in runs[kind] if k in r]) for k in keys}

    def cell(kind, key, unit):
        if kind not in kinds:
            return "not run"
        if key in med[kind]:
            return fmt(med[kind][key], unit)
        err = errors.get(kind, "")
        return "not installed" if err.startswith("not installed") else ("error" if err else "-")

    head = ["workload", "ours", "Monarch", "Ray", "zmq floor", "vs Monarch", "vs Ray", "vs floor"]
    table = [head, ["---"] * len(head)]
    for key, label, unit, higher, fkey in rows:
        ours = med["ours"].get(key)
        table.append([label, cell("ours", key, unit), cell("monarch", key, unit), cell("ray", key, unit),
                      fmt(med["floor"].get(fkey), unit) if fkey else "",
                      ratio(ours, med.get("monarch", {}).get(key), higher),
                      ratio(ours, med.get("ray", {}).get(key), higher),
                      ratio(ours, med["floor"].get(fkey), higher) if fkey else ""])
    widths = [max(len(r[c]) for r in table) for c in range(len(head))]
    print(f"\nactor runtimes, median of {RUNS} fresh-process run(s); vs X = how many times better ours is "
          f"(>1: ours better){' [TINY]' if args.tiny else ''}")
    for r in table:
        if r[0] == "---":
            r = ["-" * w for w in widths]
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    floor, ours = med["floor"].get("unix_rtt_us"), med["ours"].get("rtt_us")
    if floor and ours:
        print(f"kernel floor: a blocking Unix-socket round trip of 8 bytes, {fmt(floor, 'µs')}; "
              f"ours {fmt(ours, 'µs')}, {ours - floor:+.1f} µs over it ({ours / floor:.2f}x)")
    for kind, err in errors.items():
        print(f"{RUNTIMES[kind]}: {err[:500]}")
    print(f"total {time.perf_counter() - t0:.0f} s")

    if args.json:
        env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "tiny": args.tiny}
        try:
            git = ["git", "-C", ROOT]
            env["git"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip()
            env["git_dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                                   capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
        from importlib import metadata
        for dist in ("torch", "pyzmq", "torchmonarch", "ray", "cloudpickle"):
            try:
                env[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                env[dist] = None
        out = {"settings": settings, "env": env, "workloads": [r[0] for r in rows], "median": med,
               "errors": errors, "runs": runs}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
