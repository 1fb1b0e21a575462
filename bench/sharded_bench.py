"""Global sharded tensors benchmark: monarch-tensor's DTensors against local torch and a torchrun SPMD script.

    python bench/sharded_bench.py                                  # ours, local torch, torchrun SPMD (DTensor, FSDP2)
    python bench/sharded_bench.py --runs 1 --json bench/out/sharded_bench.json   # ~3 min on a 2-core VM
    python bench/sharded_bench.py --tiny --json /tmp/tiny.json     # every workload tiny (~1 min)
    python bench/sharded_bench.py --tiny --no-tp                   # the smoke test's run (~30 s): no 4-proc launches
    python bench/sharded_bench.py --no-tp                          # skip tp_step (4 procs per side)

Workloads (PROCS = 2 procs unless said; the same seed, model and data on every side):
  matmul_ms       ``r = dt @ dt.T`` with ``dt = distribute(randn(N, N), mesh {"dp": 2}, [Shard(0)])``, N x N fp32,
                  timed from issuing the matmul until ``r.sum().full_tensor()`` (a scalar: the sum's
                  all-reduce over both ranks, then a fetch of 4 bytes) is on the controller, so the figure
                  is the compute and its collectives, not a 64 MiB transfer. DTensor's sharding propagation
                  all-gathers ``dt.T`` (N x N/2 per rank) and each rank multiplies its N/2 rows. Local
                  torch: ``(x @ x.T).sum().item()``; SPMD: the same DTensor code in every rank.
  full_ms         the same, then ``r.full_tensor()`` instead of the sum: the whole N x N result gathered
                  on every worker and 64 MiB fetched from the first to the controller (local torch: the
                  same ``x @ x.T``; SPMD: ``full_tensor()`` in every rank, nothing to fetch).
  fsdp_step_ms    one training step of examples/train_sharded.py's GPT (MODEL, batch BATCH): forward, cross
                  entropy, ``loss.backward()``, ``torch.optim.AdamW.step()``. Ours: ``module_to_mesh(model,
                  mesh {"dp": 2})`` (every parameter Shard(0) over dp at rest), each rank fed its half of the
                  batch as a plain mesh tensor (``distribute(x, ..., Shard(0)).to_local()``), so each block
                  all-gathers its parameters into plain tensors and reduce-scatters its gradients, as FSDP2.
                  Per step = a timed loop of STEPS steps ending with a fetch of the last loss (the ranks'
                  mean; everything issued has then run on rank 0), divided by STEPS, after WARMUP_STEPS
                  untimed steps; the figure is the median of REPEATS loops.
  fsdp_dt_step_ms the same with the batch a global DTensor (``distribute``d Shard(0)): every op a DTensor
                  op on the workers, as torchrun SPMD's (DT_ROW; not with --tiny).
  tp_step_ms      the same step on mesh {"dp": 2, "tp": 2} (4 procs) with train_sharded's TP_PLAN (colwise /
                  rowwise Linear layers over tp, the rest Shard(0) over dp).

Runtimes:
  ours            this repo's controller in one process, workers spawned with ``this_host().spawn_procs``.
  local torch     the same code on local tensors in one process with PROCS x THREADS torch threads (the
                  same cores as the 2 procs). Its training step is one number, shown on both step rows.
  spmd            the equivalent SPMD script, launched as ``torchrun --standalone --nproc_per_node 2
                  bench/sharded_bench.py --spmd-worker dp`` (and ``--nproc_per_node 4 ... tp`` for tp_step):
                  gloo, a DeviceMesh("cpu", ...) over the ranks, every parameter ``distribute_tensor``ed with
                  exactly the placements module_to_mesh gives it (``src_data_rank=None``: no traffic), the
                  batch Shard(0), the same forward/backward/AdamW on DTensors. This is ours without the
                  controller: the same ops, the same collectives. Rank 0's timings are reported; its loop is
                  the same (STEPS steps, then ``loss.full_tensor()``) after a ``dist.barrier()``.
  fsdp2           the idiomatic SPMD baseline for fsdp_step: the same GPT wrapped with
                  ``torch.distributed.fsdp.fully_shard`` (FSDP2) per Block and at the root, on gloo, each rank
                  feeding its half of the batch (the loss is averaged over ranks for the loss check). Its
                  collectives differ (all-gather of each Block's parameters, reduce-scatter of gradients,
                  plain tensors inside), so ours/fsdp2 also measures DTensor-per-op against FSDP2.
Threads: every worker and every SPMD rank calls ``torch.set_num_threads(THREADS)`` (1) itself (ours via
``remote("torch.set_num_threads")``), and both get OMP_NUM_THREADS=THREADS in their environment; local torch
calls ``torch.set_num_threads(PROCS * THREADS)``. Our controller is a third process on the same cores.

Every runtime runs in its own fresh subprocess, RUNS times, interleaved so drift hits all alike; the
table shows the median over runs. Ratios: "ours/local" and "ours/spmd" (< 1: ours faster; the target of
the issue is ours/spmd <= 1.1 on the training step), "ours/fsdp2". Losses: every side's per-step losses
(first run) are printed and compared with ``allclose(rtol=1e-3)``, recorded as ``loss_match`` in the JSON;
the matmul's sum and ``[0, 0]`` likewise as ``value_match``.
Absolute numbers drift between machines: compare only ratios measured in one run. A runtime that fails
shows "error" (message under the table) and the bench still finishes.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from _runs import add_common_args, apply_common_args, interleaved, markdown, report_rank, report_worker, write_json
from _runs import launch as run_launch  # bench/ is on sys.path

# ---- settings ------------------------------------------------------------------------------
RUNS = 3             # fresh-process runs per runtime; the table shows their median
REPEATS = 3          # timed matmuls / timed step loops per workload per run (median of them)
PROCS = 2            # procs in the {"dp": 2} mesh and SPMD ranks (the tp mesh is 2 x 2)
THREADS = 1          # torch threads per worker / SPMD rank; local torch gets PROCS * THREADS
N = 4096             # the matrix is N x N fp32
MODEL = dict(VOCAB=64, BLOCK=64, N_LAYER=2, N_HEAD=4, N_EMBD=128)  # train_sharded.py's module constants
BATCH = 16           # sequences per step (split over dp)
WARMUP_STEPS = 2     # untimed steps before the timed loops
STEPS = 5            # steps per timed loop
LR = 3e-3
TP = True            # run tp_step (4 procs per side on PROCS cores)
DT_ROW = True        # also run ours' {dp: 2} step with DTensor inputs (every op a DTensor op: the path before FSDP units)
TIMEOUT = 300.0      # every fetch, in seconds
RUN_TIMEOUT = 900.0  # one runtime's whole run (a fresh subprocess; torchrun: each launch), in seconds
LOSS_RTOL = 1e-3
TINY = dict(RUNS=1, REPEATS=1, N=256, MODEL=dict(VOCAB=16, BLOCK=8, N_LAYER=1, N_HEAD=2, N_EMBD=16), BATCH=4,
            WARMUP_STEPS=1, STEPS=2, RUN_TIMEOUT=90.0, DT_ROW=False)
SETTINGS = ["RUNS", "REPEATS", "PROCS", "THREADS", "N", "MODEL", "BATCH", "WARMUP_STEPS", "STEPS", "LR", "TP", "DT_ROW",
            "TIMEOUT", "RUN_TIMEOUT", "LOSS_RTOL"]
MARKER = "SHARDED_BENCH_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNTIMES = {"ours": "monarch-tensor", "local": "local torch", "spmd": "torchrun SPMD", "fsdp2": "torchrun FSDP2"}
WORKLOADS = [  # key, label
    ("matmul_ms", "`dt @ dt.T` {N}x{N}, + sum to controller"),
    ("full_ms", "`dt @ dt.T` {N}x{N}, + full_tensor()"),
    ("fsdp_step_ms", "GPT step, FSDP {{dp: 2}} (plain units), AdamW"),
    ("fsdp_dt_step_ms", "GPT step, {{dp: 2}} DTensor inputs, AdamW"),
    ("tp_step_ms", "GPT step, {{dp: 2, tp: 2}} TP_PLAN, AdamW"),
]
STEP_KEYS = {"fsdp_step_ms": "fsdp", "fsdp_dt_step_ms": "fsdp_dt", "tp_step_ms": "tp"}


# ---- shared: model and data ----------------------------------------------------------------
def gpt_module():
    """examples/train_sharded.py with its module constants set to MODEL (its classes read them at call time)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_sharded as ts

    for k, v in MODEL.items():
        setattr(ts, k, v)
    ts.LR = LR
    return ts


def batches(ts, n):
    """n deterministic batches (train_sharded's synthetic text: sequences counting up from a random start)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        start = torch.randint(0, ts.VOCAB, (BATCH, 1), generator=g)
        seq = (start + torch.arange(ts.BLOCK + 1)) % ts.VOCAB
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def make_model(ts):
    import torch

    torch.manual_seed(0)
    return ts.GPT()


def training_step(model, pos, inputs=lambda x, y: (x, y)):
    """One step of every side: its inputs placed by ``inputs``, forward, ``loss.backward()``, AdamW."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(x, y):
        x, y = inputs(x, y)
        opt.zero_grad()
        loss = model(x, pos, y)
        loss.backward()
        opt.step()
        return loss

    return step


def timed_steps(step, data, sync, res, key, losses, barrier=lambda: None):
    """WARMUP_STEPS untimed steps, then REPEATS loops of STEPS steps each ending with ``sync(last loss)``.

    ``step(x, y)`` issues one training step and returns its loss (whatever the runtime's loss is);
    ``sync(loss)`` turns a loss into a float. Per-step ms of each loop go to ``res[key + "_loops"]``,
    their median to ``res[key]``; every step's loss (floats, fetched outside the timed region) to ``losses``.
    """
    it = iter(data)
    pending = [step(*next(it)) for _ in range(WARMUP_STEPS)]
    losses.extend(sync(v) for v in pending)
    loops = []
    for _ in range(REPEATS):
        barrier()
        pending = []
        t = time.perf_counter()
        for _ in range(STEPS):
            pending.append(step(*next(it)))
        last = sync(pending[-1])
        loops.append((time.perf_counter() - t) / STEPS * 1e3)
        losses.extend(sync(v) for v in pending[:-1])
        losses.append(last)
    res[key + "_loops"] = loops
    res[key] = statistics.median(loops)


def n_batches():
    return WARMUP_STEPS + REPEATS * STEPS


def timed_matmul(run, res, key, barrier=lambda: None):
    """One untimed ``run()``, then REPEATS timed; the median (ms) in ``res[key]``, ``run()``'s value in ``key_value``."""
    value = run()
    ts = []
    for _ in range(REPEATS):
        barrier()
        t = time.perf_counter()
        value = run()
        ts.append((time.perf_counter() - t) * 1e3)
    res[key + "_reps"] = ts
    res[key] = statistics.median(ts)
    res[key.replace("_ms", "_value")] = value


def matmuls(res, x, dist, barrier=lambda: None):
    """matmul_ms and full_ms of ``x @ x.T`` (``dist``: ``x`` is a DTensor, so fetch through ``full_tensor()``)."""
    if dist:
        timed_matmul(lambda: (x @ x.T).sum().full_tensor().item(), res, "matmul_ms", barrier)
        timed_matmul(lambda: float((x @ x.T).full_tensor()[0, 0]), res, "full_ms", barrier)
    else:
        timed_matmul(lambda: (x @ x.T).sum().item(), res, "matmul_ms")
        timed_matmul(lambda: float((x @ x.T)[0, 0]), res, "full_ms")


# ---- ours ----------------------------------------------------------------------------------
def measure_ours(res):
    import torch

    from monarch_tensor import Replicate, Shard, distribute, fetch_shard, module_to_mesh, remote, this_host

    ts = gpt_module()
    data = batches(ts, n_batches())
    res["losses"] = {}

    def spawn(shape):
        procs = this_host().spawn_procs(shape)
        with procs.activate():
            remote("torch.set_num_threads", propagate=lambda n: None)(THREADS)
        return procs

    def train(procs, plan, key, plain=False):
        names = procs._shape.names
        model = module_to_mesh(make_model(ts), procs, plan=plan)
        batch_places = {n: (Shard(0) if n == "dp" else Replicate()) for n in names}
        pos = distribute(torch.arange(ts.BLOCK), procs, {})
        if plain:  # each rank its half of the batch as a plain mesh tensor: module_to_mesh's FSDP units run
            pos = pos.to_local()
            step = training_step(model, pos, lambda x, y: (distribute(x, procs, batch_places).to_local(),
                                                            distribute(y, procs, batch_places).to_local()))
            sync = lambda loss: fetch_shard(loss.reduce("dp", "avg")).result().item()
        else:
            step = training_step(model, pos, lambda x, y: (distribute(x, procs, batch_places),
                                                            distribute(y, procs, batch_places)))
            sync = lambda loss: loss.full_tensor().item()

        losses = res["losses"][STEP_KEYS[key]] = []
        timed_steps(step, data, sync, res, key, losses)

    procs = spawn({"dp": PROCS})
    try:
        torch.manual_seed(0)
        matmuls(res, distribute(torch.randn(N, N), procs, [Shard(0)]), dist=True)
        train(procs, None, "fsdp_step_ms", plain=True)
        if DT_ROW:
            train(procs, None, "fsdp_dt_step_ms")
    finally:
        procs.stop().get(timeout=TIMEOUT)
    if TP:
        procs = spawn({"dp": PROCS, "tp": 2})
        try:
            train(procs, ts.TP_PLAN, "tp_step_ms")
        finally:
            procs.stop().get(timeout=TIMEOUT)


# ---- local torch ---------------------------------------------------------------------------
def measure_local(res):
    import torch

    torch.set_num_threads(PROCS * THREADS)
    ts = gpt_module()
    data = batches(ts, n_batches())
    torch.manual_seed(0)
    matmuls(res, torch.randn(N, N), dist=False)
    step = training_step(make_model(ts), torch.arange(ts.BLOCK))

    losses = []
    timed_steps(step, data, lambda loss: loss.item(), res, "fsdp_step_ms", losses)
    res["tp_step_ms"] = res["fsdp_dt_step_ms"] = res["fsdp_step_ms"]  # the same step: one figure for all rows
    res["losses"] = {"fsdp": losses, "fsdp_dt": losses, "tp": losses}


# ---- SPMD (one rank of torchrun) ------------------------------------------------------------
def spmd_placements(model, names, plan):
    """Every parameter's placements as module_to_mesh (controller/sharding.py) gives them, for torch's DTensor."""
    import fnmatch

    from torch import nn
    from torch.distributed.tensor import Replicate, Shard

    styles = {}
    for pattern, style in (plan or {}).items():
        styles.update({n: style for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pattern)})
    out = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            places = [Replicate()] * len(names)
            if mname in styles:
                assert isinstance(mod, nn.Linear), mname
                colwise = styles[mname] == "colwise"
                places[names.index("tp")] = Shard(0) if colwise else (Shard(1) if pname == "weight" else Replicate())
            elif p.dim() > 0:
                places[names.index("dp")] = Shard(0)
            out[(mname, pname)] = places
    return out


def spmd_worker(mode, res):
    """One torchrun rank: ``mode`` "dp" (matmul + fsdp_step), "tp" (tp_step) or "fsdp2" (fsdp_step with FSDP2)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ts = gpt_module()
        data = batches(ts, n_batches())
        shape, names = ((PROCS, 2), ("dp", "tp")) if mode == "tp" else ((PROCS,), ("dp",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        barrier = dist.barrier
        if mode == "dp":
            torch.manual_seed(0)
            matmuls(res, distribute_tensor(torch.randn(N, N), mesh, [Shard(0)], src_data_rank=None), True, barrier)
        model = make_model(ts)
        key = "tp_step_ms" if mode == "tp" else "fsdp_step_ms"
        if mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
            lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
            inputs = lambda x, y: (x[lo:hi], y[lo:hi])

            def loss_value(loss):  # the global loss: the mean of the ranks' (equal-sized) halves
                v = loss.detach().clone()
                dist.all_reduce(v)
                return v.item() / world
            pos = torch.arange(ts.BLOCK)
        else:
            places = spmd_placements(model, names, ts.TP_PLAN if mode == "tp" else None)
            for mname, mod in model.named_modules():
                for pname, p in list(mod.named_parameters(recurse=False)):
                    d = distribute_tensor(p.detach(), mesh, places[(mname, pname)], src_data_rank=None)
                    setattr(mod, pname, nn.Parameter(d, requires_grad=p.requires_grad))
                for bname, b in list(mod.named_buffers(recurse=False)):
                    setattr(mod, bname, distribute_tensor(b, mesh, [Replicate()] * len(names), src_data_rank=None))
            batch_places = [Shard(0) if n == "dp" else Replicate() for n in names]
            inputs = lambda x, y: tuple(distribute_tensor(t, mesh, batch_places, src_data_rank=None) for t in (x, y))
            loss_value = lambda loss: loss.full_tensor().item()
            pos = distribute_tensor(torch.arange(ts.BLOCK), mesh, [Replicate()] * len(names), src_data_rank=None)
        step = training_step(model, pos, inputs)

        losses = []
        timed_steps(step, data, loss_value, res, key, losses, barrier)
        res["losses"] = {STEP_KEYS[key]: losses}
        if mode == "dp" and DT_ROW:  # DTensor SPMD: the same ops as ours with DTensor inputs
            res["fsdp_dt_step_ms"] = res["fsdp_step_ms"]
            res["losses"]["fsdp_dt"] = losses
    finally:
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
    return rank


# ---- subprocess bodies -----------------------------------------------------------------------
def worker(kind):
    """Body of one fresh subprocess: measure one runtime, print the results as one JSON line."""
    def measure(res):
        import torch
        torch.set_num_threads(PROCS * THREADS if kind == "local" else THREADS)
        {"ours": measure_ours, "local": measure_local}[kind](res)

    report_worker(measure, MARKER, __file__)


def spmd_main(mode):
    report_rank(lambda res: spmd_worker(mode, res), MARKER, __file__)


# ---- orchestration (the parent process) -----------------------------------------------------
def launch(cmd, env):
    """Run ``cmd`` in its own session; the dict on its MARKER lines (with "error" on failure)."""
    return run_launch(cmd, env, MARKER, RUN_TIMEOUT, ROOT)


def run_once(kind, settings):
    """One fresh subprocess (or torchrun launch, two for spmd with TP) for ``kind``; its result dict."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = str(PROCS * THREADS if kind == "local" else THREADS)
    me = [os.path.abspath(__file__), "--settings", json.dumps(settings)]
    if kind in ("ours", "local"):
        return launch([sys.executable] + me + ["--worker", kind], env)

    def torchrun(nproc, mode):
        return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                      + me + ["--spmd-worker", mode], env)

    if kind == "fsdp2":
        return torchrun(PROCS, "fsdp2")
    res = torchrun(PROCS, "dp")
    if TP:
        tp = torchrun(PROCS * 2, "tp")
        losses = {**res.get("losses", {}), **tp.pop("losses", {})}
        if "error" in tp:
            res["error"] = "; ".join(filter(None, [res.get("error"), "tp: " + tp.pop("error")]))
        res.update(tp)
        res["losses"] = losses
    return res


def fmt(v):
    return "-" if v is None else f"{v:,.1f} ms"


def ratio(num, den):
    return f"{num / den:.2f}x" if num and den else "-"


def table(median, errors, kinds):
    cols = [RUNTIMES[k] for k in kinds]
    others = [k for k in ("local", "spmd", "fsdp2") if k in kinds and "ours" in kinds]
    head = ["workload"] + cols + [f"ours/{k}" for k in others]
    rows = []
    for key, label in WORKLOADS:
        if (key == "tp_step_ms" and not TP) or (key == "fsdp_dt_step_ms" and not DT_ROW):
            continue
        vals = {k: median.get(k, {}).get(key) for k in kinds}
        row = [label.format(N=N)]
        for k in kinds:
            na = k == "fsdp2" and key != "fsdp_step_ms"
            row.append("error" if k in errors and vals[k] is None and not na else fmt(vals[k]))
        row += [ratio(vals["ours"], vals[k]) for k in others]
        rows.append(row)
    return markdown(head, rows, errors, RUNTIMES)


def loss_checks(runs, kinds):
    """Per training workload: each side's losses (first run that has them) and whether ours matches the others."""
    import math

    losses, match = {}, {}
    for which in ("fsdp", "fsdp_dt", "tp"):
        got = {}
        for k in kinds:
            v = next((r["losses"][which] for r in runs[k] if which in r.get("losses", {})), None)
            if v:
                got[k] = v
        if not got:
            continue
        losses[which] = got
        if "ours" in got:
            match[which] = {f"ours_vs_{k}": len(v) == len(got["ours"]) and all(
                math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=1e-6) for a, b in zip(got["ours"], v))
                for k, v in got.items() if k != "ours"}
    return losses, match


def value_checks(runs, kinds):
    """Whether ours computed the same ``dt @ dt.T`` as the others (its sum, and its [0, 0] via full_tensor())."""
    import math

    first = {k: next((r for r in runs[k] if "matmul_value" in r), None) for k in kinds}
    if first.get("ours") is None:
        return {}
    return {f"ours_vs_{k}": all(math.isclose(first["ours"][v], r[v], rel_tol=LOSS_RTOL)
                                for v in ("matmul_value", "full_value"))
            for k, r in first.items() if k != "ours" and r is not None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, RUNS, ["ours", "local"])
    ap.add_argument("--no-tp", action="store_true", help="skip tp_step (4 procs on each side)")
    ap.add_argument("--only", choices=list(RUNTIMES), action="append", help="run only these runtimes")
    ap.add_argument("--spmd-worker", choices=["dp", "tp", "fsdp2"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    g = globals()
    apply_common_args(args, g)
    if args.no_tp:
        g["TP"] = False
    if args.worker:
        worker(args.worker)
        return
    if args.spmd_worker:
        spmd_main(args.spmd_worker)
        return

    settings = {k: g[k] for k in SETTINGS}
    kinds = args.only or list(RUNTIMES)
    load0 = os.getloadavg()[0]  # timings on a busy machine are slower: say how busy it was
    t0 = time.perf_counter()
    runs, errors = interleaved(kinds, RUNS, run_once, RUNTIMES, settings)
    keys = [w[0] for w in WORKLOADS if (TP or w[0] != "tp_step_ms") and (DT_ROW or w[0] != "fsdp_dt_step_ms")]
    median = {k: {key: statistics.median(r[key] for r in runs[k] if key in r)
                  for key in keys if any(key in r for r in runs[k])} for k in kinds}
    losses, match = loss_checks(runs, kinds)
    values = value_checks(runs, kinds)
    load = [round(v, 1) for v in os.getloadavg()]  # 1, 5, 15 minutes
    print(f"\nmonarch-tensor sharded bench: {PROCS} procs x {THREADS} torch thread(s) (local torch: "
          f"{PROCS * THREADS} threads), N={N}, GPT {MODEL} batch {BATCH}, {STEPS} steps a loop; median of "
          f"{RUNS} run(s) x {REPEATS} ({time.perf_counter() - t0:.0f} s); {os.cpu_count()} CPUs, "
          f"load average {load0:.1f} at start, {load[0]} at end\n")
    print(table(median, errors, kinds))
    if values:
        print("\nmatmul results (sum, [0, 0]; rtol %g): %s" % (LOSS_RTOL, ", ".join(f"{k} {v}" for k, v in values.items())))
    for which, got in losses.items():
        print(f"\n{which} losses (first run):")
        for k, v in got.items():
            print(f"  {RUNTIMES[k]:<15} {' '.join('%.5f' % x for x in v)}")
        if which in match:
            print("  match (rtol %g): %s" % (LOSS_RTOL, ", ".join(f"{k} {v}" for k, v in match[which].items())))
    if args.json:
        write_json(args.json, args.tiny, (load0, load[0]), settings=settings, workloads=keys, median=median,
                   errors=errors, losses=losses, loss_match=match, value_match=values, runs=runs)


if __name__ == "__main__":
    main()
