"""Compiled steps: what a training step costs the controller and the mesh, compiled vs uncompiled vs eager torch.

    python bench/compile_bench.py                          # the table below, ~3 min on 2 vCPUs
    python bench/compile_bench.py --json bench/out/compile_bench.json
    python bench/compile_bench.py --tiny --json /tmp/tiny.json   # smoke test
    python bench/compile_bench.py --modes compiled --runs 5      # compiled steps only (a replay's cost), ~1 min
    python bench/compile_bench.py --procs 1 --workloads mlp,gpt2,gpt8 --modes eager,compiled,stretches
    MT_BENCH_PEER_PATH=bench/out/peer-site python bench/compile_bench.py --peers --procs 1 --modes eager,compiled

Workloads (one training step each: forward, cross entropy, backward, torch.optim.SGD, zero_grad):
  mlp      Linear(256, 256) -> ReLU -> Linear(256, 10), batch 32 (notes/figures.md's MLP step)
  gptN     examples/gpt.py's GPT with N layers (GPT_CFG, batch GPT_BATCH): small, so the cost of issuing its
           ops shows (an N-layer step has about 150 N aten ops, forward, backward and SGD)
  wide     the same GPT, compute-bound: 2 layers of WIDE_CFG, batch WIDE_BATCH (issue 38's "compute-bound
           GPT step": its compiled step on 1 proc against eager)
On a mesh of 1 and of 2 procs ("gpus"; with 2, data parallel: each rank takes its half of the batch's rows
and the gradients are averaged with reduce_, so a step trains on the same batch as local eager's), each step
uncompiled and wrapped in ``compile`` (after warm-up steps that record it), and in local eager torch (no
mesh, the whole batch). Figures, medians of REPEATS loops of STEPS steps:
  ctl_us     controller time per step: the time the script spends inside a step call (µs), the median over
             every timed step (a step the machine's other work delayed does not move it)
  cpu_us     the controller thread's CPU time inside a step call (µs), the same median: what ctl_us is on an
             idle machine, and the steadier figure on a loaded one (ctl_us counts the time other processes had
             the core)
  step_ms    wall time per step, every step's work done (the loop ends with a fetch of the last loss)
  eager xN   N processes at once, each the eager step on its 1/N of the batch (no mesh, no all-reduce), the
             slowest one's figures: the floor of an N-proc data-parallel step on this machine, where processes
             side by side share what the VM gives its cores (on the 2-vCPU VM of these figures two busy
             processes each run about 1.5x slower than one alone); "step / eager xN" is over it
  msgs       instruction messages per step per proc, counted by the client (MeshClient.messages)
  params     the model's parameter tensors (a replay's guards must not cost per parameter)
  py_calls   Python function calls in the controller's thread per step (cProfile's count over STEPS steps of
             their own): its work counted, not timed, so load does not change it
  guard_us   compiled rows: a replay's guards alone (its program's ``holds``), timed in a loop of GUARD_LOOPS
             checks, the fastest of 5 (µs): the part of a replay's controller time that may grow with the
             parameter count (the other parts are one message and the results' tensors)
  compile_s  "stretches" rows (compiled steps on procs with MONARCH_TENSOR_COMPILE_STRETCHES=1, their stretches
             of aten ops run through torch.compile): seconds from the first call until a replay ran compiled
             code (inductor compiling on the procs' background thread while the steps replay op by op)
  cpu / gpt2 a compiled step's controller CPU time over the 2-layer GPT's on the same mesh (issue 38's
             target: at most 1.2 at 32 layers); calls / gpt2 the same of py_calls
Every process computes with one torch thread. With ``--peers``, PyTorch Monarch's ``compile``
(``monarch.common._coalescing.compile``, Monarch 0.7.0's path; ours has the same) runs the same steps on a
1-proc Monarch mesh, its workers on the CPU, in a fresh subprocess with torchmonarch on its path
(``MT_BENCH_PEER_PATH``: bench/dispatch_bench.py says how to install it aside): the "Monarch compiled" rows. Not
on 2 procs: Monarch's collectives (the step's ``reduce_``) need CUDA.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _runs import error_text, launch, markdown, report_worker, write_json  # noqa: E402

# ---- settings ------------------------------------------------------------------------------
PROCS = [1, 2]
WORKLOADS = ["mlp", "gpt2", "gpt8", "gpt32", "wide"]
STEPS = 10           # steps per timed loop
REPEATS = 3          # timed loops per figure (median)
WARMUP = 5           # untimed steps first (a compiled step records until it is steady)
GPT_CFG = dict(vocab_size=64, block_size=32, n_head=2, n_embd=32)
GPT_BATCH = 4
WIDE_CFG = dict(n_layer=2, vocab_size=512, block_size=128, n_head=4, n_embd=256)
WIDE_BATCH = 8
TIMEOUT = 300.0
TINY = dict(PROCS=[1], WORKLOADS=["mlp", "gpt2"], STEPS=3, REPEATS=1, WARMUP=4,
            GPT_CFG=dict(vocab_size=16, block_size=8, n_head=2, n_embd=16), GPT_BATCH=2)
SETTINGS = ["PROCS", "WORKLOADS", "STEPS", "REPEATS", "WARMUP", "GPT_CFG", "GPT_BATCH", "WIDE_CFG", "WIDE_BATCH"]
MODES = ["eager", "uncompiled", "compiled"]
ALL_MODES = MODES + ["stretches"]  # stretches: only when asked for (inductor compiles take minutes here)
GUARD_LOOPS = 2000   # a replay's guards checked this many times in a row, per timing of guard_us
COMPILE_TIMEOUT = 1800.0  # seconds a "stretches" row waits for its first replay that runs compiled code


def build(workload: str, shard=lambda t: t):
    """(model, loss function of the model) for a workload, made with a fixed seed. ``shard``: what each rank
    takes of a batch (data parallel: its rows)."""
    import torch
    import torch.nn.functional as F
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if workload == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        data, target = shard(torch.randn(32, 256)), shard(torch.randint(0, 10, (32,)))
        return model, lambda: F.cross_entropy(model(data), target)
    if workload == "wide":
        cfg, batch = GPTConfig(**WIDE_CFG), WIDE_BATCH
    else:
        cfg, batch = GPTConfig(n_layer=int(workload[3:]), **GPT_CFG), GPT_BATCH
    model = GPT(cfg)
    idx = shard(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size)))
    return model, lambda: model(idx, idx)[1]


def measure(workload: str, mode: str, procs, client, part: tuple | None = None, package: str = "monarch_tensor") -> dict:
    """One row's figures. ``part`` (eager only): ``(r, n)``, the r-th of n equal parts of the batch's rows.
    ``package``: ``monarch`` for PyTorch Monarch's tensor engine and its ``compile`` (the same code; a 1-proc
    mesh only: its collectives need CUDA)."""
    import importlib

    import torch

    pkg = importlib.import_module(package)
    compile = importlib.import_module(f"{package}.common._coalescing").compile  # (Monarch's path; ours has it too)
    fetch_shard = pkg.fetch_shard

    dp = procs is not None and package == "monarch_tensor" and len(procs._shape.ranks()) > 1
    # Data parallel: each rank its own rows of the batch (a local tensor per rank), as DDP's ranks.
    if dp:
        from monarch_tensor import Shard, distribute

        model, loss_fn = build(workload, lambda t: distribute(t, procs, {"gpus": Shard(0)}).to_local())
    else:
        model, loss_fn = build(workload, (lambda t: t.chunk(part[1])[part[0]]) if part else (lambda t: t))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        if dp:
            for p in model.parameters():
                p.grad.reduce_("gpus", "avg")
        opt.step()
        return loss.detach()

    if mode in ("compiled", "stretches"):
        step = compile(step)

    def fetch(t):
        if procs is None:
            return t.item()
        local = fetch_shard(t, gpus=0).result(TIMEOUT)
        with pkg.no_mesh.activate() if package == "monarch" else contextlib.nullcontext():  # (Monarch: local ops
            return local.item()                                                           # inside activate() fail)

    first = fetch(step())
    compile_s = None
    if mode == "stretches":  # steps until one replay ran compiled code: the compile's cost in wall time
        ran0, _, _, failed0 = stretch_counts()  # (counters per proc, over the workloads before this one)
        t0 = time.perf_counter()
        while True:
            fetch(step())
            ran, _, done, failed = stretch_counts()
            failed -= failed0
            if ran > ran0:
                compile_s = time.perf_counter() - t0
                break
            if failed and done + failed > 0 and time.perf_counter() - t0 > 60 or \
                    time.perf_counter() - t0 > COMPILE_TIMEOUT:
                break  # nothing compiled: the row shows the straight-line replay
    for _ in range(WARMUP - 1):
        loss = step()
    fetch(loss)
    ctl, cpu, wall, msgs = [], [], [], []  # (ctl, cpu: every step's own; wall: per loop)
    for _ in range(REPEATS):
        m0 = client.messages if client is not None else 0
        t0 = time.perf_counter()
        for _ in range(STEPS):
            t, c = time.perf_counter(), time.thread_time()
            loss = step()
            cpu.append((time.thread_time() - c) * 1e6)
            ctl.append((time.perf_counter() - t) * 1e6)
        last = fetch(loss)
        wall.append((time.perf_counter() - t0) / STEPS * 1e3)
        if client is not None:
            msgs.append((client.messages - m0) / STEPS / len(client.addrs))
    calls = None
    if mode != "eager":  # the controller's work per step counted, not timed: Python calls in its thread
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS):
            loss = step()
        prof.disable()
        calls = sum(v[1] for v in pstats.Stats(prof).stats.values()) / STEPS
        last = fetch(loss)
    guard_us = None
    # Ours: a replay's guards alone, in a loop of their own (no message sent).
    if mode in ("compiled", "stretches") and package == "monarch_tensor":
        import timeit

        programs = [p for e in step.entries.values() for p in e.programs]
        if programs:
            inputs = step._key((), {})[1]
            guard_us = min(timeit.repeat(lambda: programs[0].holds(inputs), number=GUARD_LOOPS, repeat=5)) \
                / GUARD_LOOPS * 1e6
    assert last == last and last < first * 1.5, f"training diverged: loss {first} -> {last}"
    return {"ctl_us": statistics.median(ctl), "cpu_us": statistics.median(cpu), "step_ms": statistics.median(wall),
            "calls": calls, "compile_s": compile_s, "guard_us": guard_us,
            "msgs": statistics.median(msgs) if msgs else None, "params": len(list(model.parameters()))}


def stretch_counts() -> list:
    """The first proc's stretch counters: compiled runs, fallbacks, compiles, failed compiles."""
    import torch
    from monarch_tensor.controller.api import remote

    from monarch_tensor import fetch_shard

    c = remote("monarch_tensor.worker.stretch.counts", propagate=lambda: torch.zeros(4, dtype=torch.int64))()
    return fetch_shard(c, gpus=0).result(TIMEOUT).tolist()


PEER_PATH = os.environ.get("MT_BENCH_PEER_PATH", "")  # torchmonarch installed aside (bench/dispatch_bench.py)
MARKER = "MONARCH-ROWS "


def monarch_rows(tiny: bool) -> dict:
    """PyTorch Monarch's ``compile`` on a 1-proc mesh of its own, every workload, in a fresh subprocess (its
    package, torchmonarch, on the path there only): ``{"w/1/Monarch compiled": row}``, or ``{"error": ...}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(PEER_PATH) if PEER_PATH else "", ROOT,
                                                      env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--monarch-rows", "--runs", str(REPEATS),
           "--workloads", ",".join(WORKLOADS)] + ["--tiny"] * tiny
    return launch(cmd, env, MARKER, TIMEOUT * len(WORKLOADS), ROOT)


def _monarch_rows(out: dict) -> None:
    """Body of monarch_rows' subprocess (``report_worker`` prints ``out``, or the error that ended it)."""
    import torch

    torch.set_num_threads(1)
    try:
        import monarch
        from monarch.actor import this_host
    except ImportError as e:
        out["error"] = f"torchmonarch is not installed ({e}; see MT_BENCH_PEER_PATH in bench/dispatch_bench.py)"
        return
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        with procs.activate():
            monarch.remote("torch.set_num_threads", propagate=lambda k: None)(1)
            for w in WORKLOADS:
                try:
                    out[f"{w}/1/Monarch compiled"] = measure(w, "compiled", procs, None, package="monarch")
                except Exception as e:  # noqa: BLE001 - reported under the table
                    out[f"{w}/1/Monarch compiled"] = {"error": error_text(e, __file__)[:300]}
    finally:
        procs.stop().get(timeout=TIMEOUT)


def eager_side_by_side(workload: str, n: int, tiny: bool) -> dict:
    """``n`` processes at once, each running the eager step on its own part of the batch (no mesh, no
    all-reduce): what ``n`` processes' compute costs on this machine when they run side by side (cores a VM
    shares, caches), the floor of any ``n``-process data-parallel step here. The slowest one's figures."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--eager-part", f"{workload},{n}", "--runs", str(REPEATS)]
    ps = [subprocess.Popen(cmd + ["--rank", str(r)] + ["--tiny"] * tiny, stdout=subprocess.PIPE, text=True)
          for r in range(n)]
    outs = []
    for p in ps:
        out, _ = p.communicate(timeout=TIMEOUT)
        if p.returncode != 0:
            raise RuntimeError(f"an eager process of {workload} failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return max(outs, key=lambda r: r["step_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write settings, figures and the load average here")
    ap.add_argument("--tiny", action="store_true", help="every workload tiny (a smoke test)")
    ap.add_argument("--runs", type=int, help=f"timed loops per figure, their median (default {REPEATS})")
    ap.add_argument("--modes", help=f"comma-separated, of {','.join(ALL_MODES)} (default {','.join(MODES)})")
    ap.add_argument("--procs", help=f"comma-separated mesh sizes (default {','.join(map(str, PROCS))})")
    ap.add_argument("--workloads", help=f"comma-separated, of {','.join(WORKLOADS)} (default all)")
    ap.add_argument("--peers", action="store_true",
                    help="also PyTorch Monarch's compile on a 1-proc mesh (torchmonarch installed aside: "
                         "MT_BENCH_PEER_PATH, see bench/dispatch_bench.py)")
    ap.add_argument("--monarch-rows", action="store_true", help=argparse.SUPPRESS)  # monarch_rows' subprocess
    ap.add_argument("--eager-part", help=argparse.SUPPRESS)  # "workload,n": one of eager_side_by_side's processes
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        globals().update(TINY)
    if args.runs:
        globals()["REPEATS"] = args.runs
    if args.eager_part:
        import json

        import torch

        torch.set_num_threads(1)
        workload, n = args.eager_part.split(",")
        print(json.dumps(measure(workload, "eager", None, None, part=(args.rank, int(n)))))
        return
    if args.modes:
        bad = set(args.modes.split(",")) - set(ALL_MODES)
        if bad:
            ap.error(f"--modes: unknown {sorted(bad)}; choose from {ALL_MODES}")
        globals()["MODES"] = [m for m in ALL_MODES if m in args.modes.split(",")]
    if args.workloads:
        bad = set(args.workloads.split(",")) - set(WORKLOADS)
        if bad:
            ap.error(f"--workloads: unknown {sorted(bad)}; choose from {WORKLOADS}")
        globals()["WORKLOADS"] = [w for w in WORKLOADS if w in args.workloads.split(",")]
    if args.procs:
        globals()["PROCS"] = [int(n) for n in args.procs.split(",")]
    if args.monarch_rows:
        report_worker(_monarch_rows, MARKER, __file__)
    import torch
    from monarch_tensor.controller.api import client_for, remote

    from monarch_tensor import proc_mesh, this_host

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    results: dict = {}
    mesh_modes = [m for m in ("uncompiled", "compiled") if m in MODES]
    row_modes = mesh_modes + ["stretches"] * ("stretches" in MODES)
    for w in WORKLOADS if "eager" in MODES else ():
        results[f"{w}/eager"] = measure(w, "eager", None, None)
        for n in PROCS:
            if n > 1:
                results[f"{w}/{n}/eager"] = eager_side_by_side(w, n, args.tiny)
    for n in PROCS:
        procs = this_host().spawn_procs(per_host={"gpus": n})
        try:
            with procs.activate():
                remote("torch.set_num_threads", propagate=lambda k: None)(1)
                client = client_for(procs)
                for w in WORKLOADS:
                    for mode in mesh_modes:
                        results[f"{w}/{n}/{mode}"] = measure(w, mode, procs, client)
        finally:
            procs.stop().get(timeout=TIMEOUT)
        if "stretches" in MODES:  # procs whose programs hand their stretches to torch.compile
            procs = proc_mesh(gpus=n, env={"MONARCH_TENSOR_COMPILE_STRETCHES": "1"})
            try:
                with procs.activate():
                    remote("torch.set_num_threads", propagate=lambda k: None)(1)
                    client = client_for(procs)
                    for w in WORKLOADS:
                        results[f"{w}/{n}/stretches"] = measure(w, "stretches", procs, client)
            finally:
                procs.stop().get(timeout=TIMEOUT)
    if args.peers and 1 in PROCS and "compiled" in MODES:
        results.update(monarch_rows(args.tiny))
    load1 = os.getloadavg()
    head = ["workload", "params", "procs", "mode", "ctl_us", "cpu_us", "py_calls", "guard_us", "step_ms", "msgs",
            "step / eager", f"step / eager x{max(PROCS)}", "cpu / gpt2", "calls / gpt2", "compile_s"]
    rows: list = []
    notes: list = []  # rows that failed (a peer's), under the table
    for w in WORKLOADS:
        eager = results.get(f"{w}/eager")
        if eager is not None:
            rows.append([w, str(eager["params"]), "-", "eager", f"{eager['ctl_us']:.0f}", f"{eager['cpu_us']:.0f}",
                         "-", "-", f"{eager['step_ms']:.2f}", "-", "1.00", "-", "-", "-", "-"])
        for n in PROCS:
            side = results.get(f"{w}/{n}/eager")
            if side is not None:
                rows.append([w, str(side["params"]), str(n), f"eager x{n}", f"{side['ctl_us']:.0f}",
                             f"{side['cpu_us']:.0f}", "-", "-", f"{side['step_ms']:.2f}", "-",
                             f"{side['step_ms'] / eager['step_ms']:.2f}", "1.00", "-", "-", "-"])
            peer = ["Monarch compiled"] if f"{w}/{n}/Monarch compiled" in results else []
            for mode in row_modes + peer:
                r = results[f"{w}/{n}/{mode}"]
                if "error" in r:
                    notes.append(f"{w}, {mode}: {r['error']}")
                    continue
                base = results.get(f"gpt2/{n}/{mode}") if mode.endswith("compiled") and w.startswith("gpt") else None
                rows.append([w, str(r["params"]), str(n), mode, f"{r['ctl_us']:.0f}", f"{r['cpu_us']:.0f}",
                             f"{r['calls']:.0f}",
                             f"{r['guard_us']:.1f}" if r.get("guard_us") is not None else "-",
                             f"{r['step_ms']:.2f}", f"{r['msgs']:.1f}" if r.get("msgs") is not None else "-",
                             f"{r['step_ms'] / eager['step_ms']:.2f}" if eager else "-",
                             f"{r['step_ms'] / side['step_ms']:.2f}" if side else "-",
                             f"{r['cpu_us'] / base['cpu_us']:.2f}" if base else "-",
                             f"{r['calls'] / base['calls']:.2f}" if base else "-",
                             f"{r['compile_s']:.0f}" if r.get("compile_s") is not None else "-"])
    print(markdown(head, rows, {}, {}))
    if "error" in results:
        notes.append(f"Monarch: {results['error']}")
    for note in notes:
        print(note)
    print(f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")
    if args.json:
        write_json(args.json, args.tiny, (load0[0], load1[0]),
                   settings={k: globals()[k] for k in SETTINGS + ["MODES"]},
                   results=results)


if __name__ == "__main__":
    main()
