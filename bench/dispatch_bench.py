"""Tensor-engine benchmark: what the controller pays to issue ops, against PyTorch Monarch and eager torch.

    python bench/dispatch_bench.py                                   # ours + eager local torch
    MT_BENCH_PEER_PATH=bench/out/peer-site python bench/dispatch_bench.py --peers --json bench/out/dispatch_bench.json
    python bench/dispatch_bench.py --tiny --json /tmp/tiny.json      # smoke test, every workload tiny

Workloads, on a mesh of GPUS procs (default 1; "gpus" is only a name) with the mesh active:
  indep_us        issuing N_OPS independent ``y = x + 1`` (8 elements), per op, caches warm (µs);
                  the ops are then fetched outside the timed region so no run leaks into the next
  chain_us        issuing a dependent chain ``x = x + 1`` of N_OPS ops, per op (µs)
  fetch_ms        one ``y = x + 1`` then ``fetch_shard(y, gpus=0).result()``, round trip (ms)
  ready_ms        ``fetch_shard(x, gpus=0).result()`` of a value computed before (a loss after its loop, a
                  result looked at again), round trip (ms)
  mlp_ms          the MLP step of notes/figures.md: Linear(256, 256) -> ReLU -> Linear(256, 10), batch 32,
                  cross entropy, backward, torch.optim.SGD; N_STEPS steps then a fetch of the last loss,
                  per step (ms; everything issued has run by the end of the timed region)
  gpt_ms          a compute-bound step of examples/gpt.py's GPT (GPT_CFG, batch GPT_BATCH; eager takes
                  >= 20 ms a step on a 2-vCPU VM), backward, SGD, timed like mlp_ms (ms)
Eager local torch runs the same code on local tensors (no mesh; "fetch" is a no-op). Every process
computes with THREADS torch threads: the controller, eager, and each worker (set with ``remote``).

Every runtime runs in its own fresh subprocess, RUNS times, interleaved so drift hits all alike; each
figure is the median of REPEATS timed loops, and the table shows the median over runs. Ratios:
"Monarch/ours" (> 1: ours faster) and "ours/eager" (the engine's overhead; 1.00 = none). Absolute
numbers drift between machines: compare only ratios measured in one run. --json PATH writes settings,
medians and every run's raw numbers.

Peers are optional and never dependencies of monarch-tensor. torchmonarch 0.7.0 runs its tensor
engine on CPU-only machines (workers on CPU, the same ``activate()``/``fetch_shard`` API as ours);
it needs cloudpickle>=3, so install it aside and point MT_BENCH_PEER_PATH at it (put on PYTHONPATH
for the peer's subprocess only):
    pip install --target bench/out/peer-site torchmonarch==0.7.0 cloudpickle==3.1.2
A runtime that is missing or fails shows up as "not installed" or "error" (message under the table)
and the bench still finishes.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

from _runs import add_common_args, apply_common_args, interleaved, launch, markdown, write_json  # on sys.path

# ---- settings ------------------------------------------------------------------------------
RUNS = 3             # fresh-process runs per runtime; the table shows their median
REPEATS = 5          # timed loops per workload per run (median of them)
GPUS = 1             # procs in the mesh
THREADS = 1          # torch threads in every process (controller, eager, each worker)
N_OPS = 1000         # ops per timed loop (indep, chain)
WARMUP_OPS = 200     # untimed ops before the first loop (fills the shape caches)
N_FETCH = 50         # op + fetch round trips per timed loop
N_STEPS = 20         # MLP steps per timed loop
GPT_STEPS = 5        # GPT steps per timed loop
GPT_CFG = dict(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=128)
GPT_BATCH = 16
PEER_SCALE = 0.1     # Monarch (about 1 ms an op) runs this fraction of the loop sizes above
TIMEOUT = 120.0      # every fetch, in seconds
RUN_TIMEOUT = 600.0  # one runtime's whole run (a fresh subprocess), in seconds
TINY = dict(RUNS=1, REPEATS=2, N_OPS=50, WARMUP_OPS=20, N_FETCH=5, N_STEPS=3, GPT_STEPS=2,
            GPT_CFG=dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16), GPT_BATCH=2,
            PEER_SCALE=1.0, RUN_TIMEOUT=100.0)
SETTINGS = ["RUNS", "REPEATS", "GPUS", "THREADS", "N_OPS", "WARMUP_OPS", "N_FETCH", "N_STEPS", "GPT_STEPS",
            "GPT_CFG", "GPT_BATCH", "PEER_SCALE", "TIMEOUT", "RUN_TIMEOUT"]
PEER_PATH = os.environ.get("MT_BENCH_PEER_PATH", "")
MARKER = "DISPATCH_BENCH_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNTIMES = {"ours": "monarch-tensor", "monarch": "Monarch", "eager": "eager torch"}
WORKLOADS = [  # key, label, unit
    ("indep_us", "y = x + 1, independent, per op issued", "µs"),
    ("chain_us", "x = x + 1, dependent chain, per op issued", "µs"),
    ("fetch_ms", "one op + fetch_shard round trip", "ms"),
    ("ready_ms", "fetch_shard of a computed value, round trip", "ms"),
    ("mlp_ms", "MLP step 256-256-10, batch 32, bwd + SGD", "ms"),
    ("gpt_ms", "GPT step (compute-bound), bwd + SGD", "ms"),
]


# ---- runtimes (in the worker subprocess) ---------------------------------------------------
class Mesh:
    """Ours and PyTorch Monarch: the same script, only the import differs."""

    def __init__(self, package):
        self.pkg = __import__(package, fromlist=["fetch_shard", "remote"])
        self.actor = __import__(f"{package}.actor", fromlist=["this_host"])
        self.procs = None

    def start(self):
        self.procs = self.actor.this_host().spawn_procs(per_host={"gpus": GPUS})
        with self.activate():
            self.pkg.remote("torch.set_num_threads", propagate=lambda n: None)(THREADS)

    def activate(self):
        return self.procs.activate()

    def fetch(self, t):
        """Rank 0's value of mesh tensor ``t`` as a Python list (or number)."""
        local = self.pkg.fetch_shard(t, gpus=0).result(timeout=TIMEOUT)
        nm = self.pkg.no_mesh  # Monarch: an object with .activate(); local ops on a live mesh are errors there
        with (nm.activate() if hasattr(nm, "activate") else nm()):
            return local.tolist()

    def stop(self):
        if self.procs is not None:
            self.procs.stop().get(timeout=TIMEOUT)


class Eager:
    """Local torch: no mesh, a fetch is the tensor itself."""

    def start(self):
        pass

    def activate(self):
        return contextlib.nullcontext()

    def fetch(self, t):
        return t.tolist()

    def stop(self):
        pass


def median_of(fn, repeats):
    return statistics.median(fn() for _ in range(repeats))


def measure(rt, res, scale=1.0):
    """Fill ``res`` with every workload's figure for runtime ``rt`` (loop sizes times ``scale``)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig

    n_ops, n_fetch = max(10, int(N_OPS * scale)), max(3, int(N_FETCH * scale))
    n_steps, gpt_steps = max(2, int(N_STEPS * scale)), max(2, int(GPT_STEPS * scale))
    rt.start()
    try:
        with rt.activate():
            x = torch.randint(0, 100, (8,)).float()  # data made on the workers: no value known here
            for _ in range(max(10, int(WARMUP_OPS * scale))):
                x = x + 1
            assert rt.fetch(x)[0] > 0

            def indep():
                t = time.perf_counter()
                for _ in range(n_ops):
                    y = x + 1
                dt = time.perf_counter() - t
                assert rt.fetch(y)[0] == rt.fetch(x)[0] + 1
                return dt / n_ops * 1e6
            res["indep_us"] = median_of(indep, REPEATS)

            def chain():
                nonlocal x
                start = rt.fetch(x)[0]
                t = time.perf_counter()
                for _ in range(n_ops):
                    x = x + 1
                dt = time.perf_counter() - t
                assert rt.fetch(x)[0] == start + n_ops
                return dt / n_ops * 1e6
            res["chain_us"] = median_of(chain, REPEATS)

            def fetch():
                ts = []
                for _ in range(n_fetch):
                    t = time.perf_counter()
                    rt.fetch(x + 1)
                    ts.append(time.perf_counter() - t)
                return statistics.median(ts) * 1e3
            res["fetch_ms"] = median_of(fetch, REPEATS)

            def ready():
                ts = []
                rt.fetch(x)
                for _ in range(n_fetch):
                    t = time.perf_counter()
                    rt.fetch(x)
                    ts.append(time.perf_counter() - t)
                return statistics.median(ts) * 1e3
            res["ready_ms"] = median_of(ready, REPEATS)

            torch.manual_seed(0)
            mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
            data, target = torch.randn(32, 256), torch.randint(0, 10, (32,))
            res["mlp_ms"] = median_of(lambda: steps(rt, mlp, lambda: F.cross_entropy(mlp(data), target),
                                                    n_steps), REPEATS)

            cfg = GPTConfig(**GPT_CFG)
            gpt = GPT(cfg)
            idx = torch.randint(0, cfg.vocab_size, (GPT_BATCH, cfg.block_size))
            res["gpt_ms"] = median_of(lambda: steps(rt, gpt, lambda: gpt(idx, idx)[1], gpt_steps), REPEATS)
    finally:
        rt.stop()


def steps(rt, model, loss_fn, n, lr=1e-3):
    """ms per training step: one untimed step, then n steps and a fetch of the last loss."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    first = rt.fetch(step())
    t = time.perf_counter()
    for _ in range(n):
        loss = step()
    last = rt.fetch(loss)
    dt = time.perf_counter() - t
    assert last == last and last < first * 1.5, f"training diverged: loss {first} -> {last}"
    return dt / n * 1e3


def worker(kind):
    """Body of one fresh subprocess: measure one runtime, print the results as one JSON line."""
    res = {}
    try:
        import torch
        torch.set_num_threads(THREADS)
        try:
            rt = {"ours": lambda: Mesh("monarch_tensor"), "monarch": lambda: Mesh("monarch"), "eager": Eager}[kind]()
        except ImportError as e:
            res["error"] = f"not installed ({e})"
            return
        measure(rt, res, scale=PEER_SCALE if kind == "monarch" else 1.0)
    except BaseException as e:  # noqa: BLE001 - reported in the table
        ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == os.path.abspath(__file__)]
        res["error"] = f"{type(e).__name__}: {e}" + (f" (dispatch_bench.py:{ours[-1].lineno})" if ours else "")
        traceback.print_exc()
        if kind == "monarch" and "cloudpickle" in str(e):
            res["error"] = "torchmonarch needs cloudpickle>=3 (see MT_BENCH_PEER_PATH in the docstring): " + res["error"]
    finally:
        print(MARKER + json.dumps(res), flush=True)
        sys.stdout.flush()
        os._exit(0)  # a runtime's leftover threads must not keep the subprocess alive


# ---- orchestration (the parent process) -----------------------------------------------------
def run_once(kind, settings):
    """One fresh subprocess for ``kind``; returns its result dict (with "error" on failure)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    if kind == "monarch" and PEER_PATH:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(PEER_PATH), env["PYTHONPATH"]])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--settings", json.dumps(settings)]
    return launch(cmd, env, MARKER, RUN_TIMEOUT, ROOT)


def fmt(v, unit):
    if v is None:
        return "-"
    return f"{v:,.1f} µs" if unit == "µs" else f"{v:,.2f} ms"


def ratio(num, den):
    return f"{num / den:.2f}x" if num and den else "-"


def table(median, errors, kinds):
    cols = [RUNTIMES[k] for k in kinds]
    head = ["workload"] + cols + (["Monarch/ours"] if "monarch" in kinds else []) + ["ours/eager"]
    rows = []
    for key, label, unit in WORKLOADS:
        vals = {k: median.get(k, {}).get(key) for k in RUNTIMES}
        row = [label] + [("error" if k in errors and vals[k] is None else fmt(vals[k], unit)) for k in kinds]
        if "monarch" in kinds:
            row.append(ratio(vals["monarch"], vals["ours"]))
        row.append(ratio(vals["ours"], vals["eager"]))
        rows.append(row)
    return markdown(head, rows, errors, RUNTIMES)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", action="store_true", help="also run PyTorch Monarch's tensor engine when importable")
    add_common_args(ap, RUNS, RUNTIMES)
    ap.add_argument("--only", choices=list(RUNTIMES), action="append", help="run only these runtimes")
    args = ap.parse_args()
    g = globals()
    apply_common_args(args, g)
    if args.worker:
        worker(args.worker)
        return

    settings = {k: g[k] for k in SETTINGS}
    kinds = args.only or (["ours", "eager"] + (["monarch"] if args.peers else []))
    load0 = os.getloadavg()[0]  # timings on a busy machine are slower: say how busy it was
    t0 = time.perf_counter()
    runs, errors = interleaved(kinds, RUNS, run_once, RUNTIMES, settings)
    median = {k: {key: statistics.median(r[key] for r in runs[k] if key in r)
                  for key, _, _ in WORKLOADS if any(key in r for r in runs[k])} for k in kinds}
    load = [round(v, 1) for v in os.getloadavg()]  # 1, 5, 15 minutes
    print(f"\nmonarch-tensor dispatch bench: mesh of {GPUS} proc(s), {THREADS} torch thread(s) per process, "
          f"median of {RUNS} run(s) x {REPEATS} loops ({time.perf_counter() - t0:.0f} s); "
          f"{os.cpu_count()} CPUs, load average {load0:.1f} at start, {load[0]} at end\n")
    print(table(median, errors, kinds))
    if args.json:
        write_json(args.json, args.tiny, (load0, load[0]), settings=settings, workloads=[w[0] for w in WORKLOADS],
                   median=median, errors=errors, runs=runs)


if __name__ == "__main__":
    main()
