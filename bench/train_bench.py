"""Training a small GPT (tied embeddings) on every layout, ours beside torchrun's, with the defaults a user gets.

    python bench/train_bench.py                                    # every layout, ours and torchrun, local eager
    python bench/train_bench.py --runs 2 --json bench/out/train_bench.json
    python bench/train_bench.py --steps 10 --layers 4              # longer timed loops, a deeper model
    python bench/train_bench.py --tiny --no-tp --json /tmp/t.json  # the smoke test's run: tiny, no 4-proc launches
    python bench/train_bench.py --fused --no-tp                    # fused AdamW everywhere, and our compiled steps

The model is examples/gpt.py's GPT (LAYERS blocks, N_EMBD wide, lm_head.weight *is* wte.weight), trained with
``torch.optim.AdamW`` on windows of examples/data's corpus: BATCH sequences a step in all, split over dp. Every
runtime draws the same initial weights (``torch.manual_seed(SEED)``) and the same batches, so every loss can be
checked against local eager torch.

Runtimes, each in fresh processes, runs interleaved (``--only`` picks some):
  local         local eager torch in one process
  fsdp          ours: ``module_to_mesh(model, procs {"dp": 2})``, each rank its half batch as a plain mesh tensor
                (as FSDP2 takes it: each block all-gathers its parameters and computes on plain tensors)
  fsdp2         torchrun, 2 ranks: ``fully_shard`` (FSDP2) per Block, then the root; each rank its half batch
  ddp           ours: the model built inside ``procs.activate()`` (replicated), each rank its half batch,
                ``reduce_([p.grad ...], "dp", "avg")`` after ``loss.backward()`` (examples/train_ddp.py)
  torch_ddp     torchrun, 2 ranks: ``DistributedDataParallel`` (gloo, its buckets)
  fsdp_c        ours, with ``--fused``: the fsdp layout, the whole step (forward, backward, AdamW) under
                ``monarch_tensor.compile``
  ddp_c         ours, with ``--fused``: the ddp layout, the whole step (with its ``reduce_``) under ``compile``
  tp_c          ours, with ``--fused``: the tp layout, each step's batch ``distribute``d on its own, the whole step
                under ``compile``
  tp            ours: ``module_to_mesh(model, procs {"dp": 2, "tp": 2}, plan=TP_PLAN)``
  fsdp2_tp      torchrun, 4 ranks: ``init_device_mesh(("dp", "tp"))``, ``parallelize_module`` of each Block with
                TP_PLAN's colwise / rowwise styles on "tp", then ``fully_shard`` over "dp" (the fused qkv's
                output stays a DTensor, ``use_local_output=False``, under ``implicit_replication()``)
``--fused``: every runtime's AdamW is ``fused=True`` (one op for all parameters; compile needs it, since the
default AdamW reads its step count on the host), and the compiled layouts run too. Threads: nobody sets any. OMP_NUM_THREADS is removed from every runtime's environment, so torchrun applies its
own default (1 thread a rank) and our procs and local torch theirs.

Per runtime: the first step alone (from issuing it to its loss on the controller / rank 0, on warm procs with the
model placed) is "first step s"; then WARMUP - 1 untimed steps and REPEATS loops of STEPS steps, each ending
when its last loss is on the controller (rank 0's under torchrun); "step ms" is the median loop's per-step time,
then the median over RUNS runs. "/ torchrun" is ours over its torchrun peer (the issue's target: <= 1.1x).
"CPU ms": the CPU time a step costs every process of the runtime together (ours: the controller and its procs;
torchrun: every rank; each loop's, the median as for "step ms"). Other work on the machine stretches wall
times far more than it changes this, so on a loaded machine its ratio is the steadier comparison of the work
each runtime does; the wall-time target is for a quiet one.
"losses match": the global loss of each of the first CHECK_STEPS steps within LOSS_TOL of local eager's
(a layout that unties lm_head from wte trains a different model and shows "no"). Absolute numbers drift
between machines; compare ratios measured in one run.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runs import (
    add_common_args,
    apply_common_args,
    interleaved,
    markdown,
    report_rank,
    report_worker,
    timed_training,
    tree_cpu_s,
    write_json,
)
from _runs import launch as run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- settings ------------------------------------------------------------------------------
DP, TP = 2, 2            # the {"dp": DP} meshes / torchrun ranks; {"dp": DP, "tp": TP} for the TP layout
LAYERS = 2               # GPT blocks (--layers)
N_HEAD, N_EMBD = 4, 128
BLOCK = 64               # characters per sequence
BATCH = 16               # sequences per step, in all (split over dp)
LR = 3e-3
SEED = 1337
WARMUP = 2               # the first step (timed alone) and WARMUP - 1 more, untimed
STEPS = 5                # steps per timed loop (--steps)
REPEATS = 3              # timed loops per run
RUNS = 1                 # fresh-process runs per runtime
CHECK_STEPS = 3          # losses compared with local eager's over the first CHECK_STEPS steps
LOSS_TOL = 1e-4          # absolute
TIMEOUT = 300.0          # any fetch, in seconds
RUN_TIMEOUT = 900.0      # one runtime's whole run
FUSED = False            # --fused: AdamW(fused=True) everywhere, and the compiled layouts
TP_PLAN = {"*.attn.qkv": "colwise", "*.attn.proj": "rowwise", "*.mlp.fc": "colwise", "*.mlp.proj": "rowwise"}
NO_TP = False
TINY = dict(LAYERS=1, N_HEAD=2, N_EMBD=16, BLOCK=8, BATCH=4, WARMUP=2, STEPS=2, REPEATS=1, RUNS=1,
            RUN_TIMEOUT=120.0)
SETTINGS = ["DP", "TP", "LAYERS", "N_HEAD", "N_EMBD", "BLOCK", "BATCH", "LR", "SEED", "WARMUP", "STEPS", "REPEATS",
            "RUNS", "CHECK_STEPS", "LOSS_TOL", "TIMEOUT", "RUN_TIMEOUT", "TP_PLAN", "NO_TP", "FUSED"]
MARKER = "TRAIN_BENCH_RESULT "

RUNTIMES = {"local": "local eager", "fsdp": "ours {dp: 2} FSDP", "fsdp_c": "ours {dp: 2} FSDP, compiled",
            "fsdp2": "torchrun FSDP2", "ddp": "ours {dp: 2} DDP", "ddp_c": "ours {dp: 2} DDP, compiled",
            "torch_ddp": "torchrun DDP", "tp": "ours {dp: 2, tp: 2}", "tp_c": "ours {dp: 2, tp: 2}, compiled",
            "fsdp2_tp": "torchrun FSDP2+TP"}
PEERS = {"fsdp": "fsdp2", "fsdp_c": "fsdp2", "ddp": "torch_ddp", "ddp_c": "torch_ddp", "tp": "fsdp2_tp",
         "tp_c": "fsdp2_tp"}
OURS = ("fsdp", "fsdp_c", "ddp", "ddp_c", "tp", "tp_c")
COMPILED = ("fsdp_c", "ddp_c", "tp_c")  # only with --fused
TORCHRUN = {"fsdp2": "fsdp2", "torch_ddp": "ddp", "fsdp2_tp": "tp"}  # kind -> the torchrun worker's mode
FOUR_PROCS = ("tp", "tp_c", "fsdp2_tp")


# ---- the model and the data, the same for every runtime -------------------------------------------------
def gpt():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt

    return gpt


def data():
    """The corpus, the model's config and every step's global batch: X, Y (n_steps, BATCH, BLOCK) int64."""
    import torch

    g = gpt()
    text = g.load_corpus()
    tok = g.CharTokenizer(text)
    ids = torch.tensor(tok.encode(text))
    cfg = g.GPTConfig(vocab_size=tok.vocab_size, block_size=BLOCK, n_layer=LAYERS, n_head=N_HEAD, n_embd=N_EMBD)
    n = WARMUP + STEPS * REPEATS
    offs = g.batch_offsets(len(ids), BLOCK, BATCH, torch.Generator().manual_seed(SEED), shape=(n,))
    xy = [g.get_batch(ids, offs[i], BLOCK) for i in range(n)]
    return cfg, torch.stack([x for x, _ in xy]), torch.stack([y for _, y in xy])


def new_model(cfg):
    import torch

    torch.manual_seed(SEED)
    return gpt().GPT(cfg)


def adamw_step(model, sync=None):
    """``step(x, y)``: forward, ``loss.backward()``, ``sync()`` (the gradients' all-reduce, if any), AdamW."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if FUSED else {}))

    def step(x, y):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()
        return loss

    return step


def record(res, timing, value, tied):
    res["step_ms"], res["first_s"], res["loops_ms"] = timing["step_ms"], timing["first_s"], timing["loops_ms"]
    if "cpu_ms" in timing:
        res["cpu_ms"], res["cpu_loops_ms"] = timing["cpu_ms"], timing["cpu_loops_ms"]
    res["losses"] = [value(v) for v in timing["losses"]]
    res["tied"] = tied


# ---- ours ----------------------------------------------------------------------------------------
def measure_ours(kind, res):
    import torch

    from monarch_tensor import Replicate, Shard, compile, distribute, fetch_shard, module_to_mesh, reduce_, this_host

    cfg, X, Y = data()
    n = X.shape[0]
    shape = {"dp": DP, "tp": TP} if kind in ("tp", "tp_c") else {"dp": DP}
    procs = this_host().spawn_procs(per_host=shape)
    try:
        with procs.activate():
            fetch_shard(torch.zeros(1), {d: 0 for d in shape}).result(timeout=TIMEOUT)  # warm procs
            if kind in ("ddp", "ddp_c", "fsdp", "fsdp_c"):  # each rank its half batch, as plain mesh tensors
                if kind in ("fsdp", "fsdp_c"):
                    model = module_to_mesh(new_model(cfg), procs)
                    step = adamw_step(model)
                else:
                    torch.manual_seed(SEED)  # seeds every rank: the same initial weights as local torch's
                    model = gpt().GPT(cfg)
                    params = list(model.parameters())
                    step = adamw_step(model, lambda: reduce_([p.grad for p in params], "dp", "avg"))
                rank = procs.rank_tensor("dp").reshape(1)
                b = BATCH // DP

                def mine(t):  # every step's batch on every rank, then this rank's rows of each, one tensor a step
                    rows = torch.tensor(t.view(n, DP, b, BLOCK).tolist()).index_select(1, rank).view(n, b, BLOCK)
                    return [r.clone() for r in rows.unbind(0)]  # (a compiled step's key includes storage offsets)

                xs, ys = mine(X), mine(Y)
                if kind in COMPILED:
                    inner = step
                    step = compile(lambda x, y: inner(x, y).detach(), verify=False)

                def wait(loss):
                    return fetch_shard(loss.detach(), dp=0).result(timeout=TIMEOUT)

                def value(loss):
                    return float(fetch_shard(loss.detach().reduce("dp", "avg"), dp=0).result(timeout=TIMEOUT))
            else:
                model = module_to_mesh(new_model(cfg), procs, plan=TP_PLAN if kind in ("tp", "tp_c") else None)
                if kind == "tp_c":  # one DTensor a step (views of one would differ in storage offset: new keys)
                    places = {d: (Shard(0) if d == "dp" else Replicate()) for d in shape}  # (batch, pos)
                    xs = [distribute(X[i], procs, places) for i in range(n)]
                    ys = [distribute(Y[i], procs, places) for i in range(n)]
                    inner = adamw_step(model)
                    step = compile(lambda x, y: inner(x, y).detach(), verify=False)
                else:
                    places = {d: (Shard(1) if d == "dp" else Replicate()) for d in shape}  # (step, batch, pos)
                    xs, ys = distribute(X, procs, places), distribute(Y, procs, places)
                    step = adamw_step(model)

                def wait(loss):
                    return loss.full_tensor().item()

                value = wait
            tied = model.lm_head.weight is model.wte.weight
            timing = timed_training(step, ((xs[i], ys[i]) for i in range(n)), wait, WARMUP, STEPS, REPEATS,
                                    cpu=tree_cpu_s)  # this controller and the procs it spawned
            record(res, timing, value, tied)
            if kind in COMPILED:
                from monarch_tensor.controller.compile import stats

                res["replays"] = stats["replays"]
    finally:
        procs.stop().get(timeout=TIMEOUT)


def measure_local(res):
    cfg, X, Y = data()
    model = new_model(cfg)
    timing = timed_training(adamw_step(model), zip(X, Y), lambda loss: loss.item(), WARMUP, STEPS, REPEATS,
                            cpu=time.process_time)
    record(res, timing, lambda loss: loss.item(), model.lm_head.weight is model.wte.weight)


# ---- torchrun (one rank) -------------------------------------------------------------------------
def torch_worker(mode, res):
    """One rank of a torchrun launch: ``mode`` "fsdp2", "ddp" or "tp" (FSDP2 + TP)."""
    import contextlib

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cfg, X, Y = data()
        model = new_model(cfg)
        ctx = contextlib.nullcontext
        dp_rank = rank
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
            tied = model.module.lm_head.weight is model.module.wte.weight
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if mode == "tp":
                from torch.distributed.tensor.experimental import implicit_replication
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
                styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
                plan = {k.removeprefix("*."): styles[v]() for k, v in TP_PLAN.items()}
                plan["attn.qkv"] = ColwiseParallel(use_local_output=False)  # split into q, k, v: stays a DTensor
                for blk in model.blocks:
                    parallelize_module(blk, mesh["tp"], plan)
                dp_mesh, dp_rank, ctx = mesh["dp"], mesh["dp"].get_local_rank(), implicit_replication
            else:
                dp_mesh = init_device_mesh("cpu", (DP,), mesh_dim_names=("dp",))
            for blk in model.blocks:
                fully_shard(blk, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
            tied = model.lm_head.weight is model.wte.weight
        b = BATCH // DP
        lo = dp_rank * b
        inner = adamw_step(model)

        def step(x, y):
            with ctx():
                return inner(x[lo:lo + b], y[lo:lo + b])

        def value(loss):  # the global loss: the mean over dp of the ranks' (equal-sized) parts
            v = loss.detach().clone()
            dist.all_reduce(v)
            return v.item() / world

        def cpu():  # every rank's CPU time so far, summed (each rank's loop is the same)
            t = torch.tensor([time.process_time()], dtype=torch.float64)
            dist.all_reduce(t)
            return t.item()

        timing = timed_training(step, zip(X, Y), lambda loss: loss.item(), WARMUP, STEPS, REPEATS, dist.barrier, cpu)
        record(res, timing, value, tied)
    finally:
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
    return rank


# ---- orchestration -------------------------------------------------------------------------------
def worker(kind):
    report_worker(lambda res: measure_local(res) if kind == "local" else measure_ours(kind, res), MARKER, __file__)


def run_once(kind, settings):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the defaults a user gets
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    me = [os.path.abspath(__file__), "--settings", json.dumps(settings)]
    if kind in TORCHRUN:
        nproc = DP * TP if kind == "fsdp2_tp" else DP
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + me + [
            "--torch-worker", TORCHRUN[kind]]
    else:
        cmd = [sys.executable] + me + ["--worker", kind]
    return run_launch(cmd, env, MARKER, RUN_TIMEOUT, ROOT)


def loss_match(runs, kinds):
    """Per runtime: whether its first CHECK_STEPS losses (first run) are within LOSS_TOL of local eager's."""
    first = {k: next((r["losses"] for r in runs[k] if "losses" in r), None) for k in kinds}
    ref = first.get("local")
    if ref is None:
        return first, {}
    n = min(CHECK_STEPS, len(ref))
    return first, {k: v is not None and len(v) >= n and all(abs(a - b) <= LOSS_TOL for a, b in zip(v[:n], ref[:n]))
                   for k, v in first.items() if k != "local"}


def table(median, match, errors, kinds):
    rows = []
    for k in kinds:
        got, peer = median.get(k, {}), median.get(PEERS.get(k), {})
        ms, cpu = got.get("step_ms"), got.get("cpu_ms")
        ratio = f"{ms / peer['step_ms']:.2f}x" if ms and peer.get("step_ms") else ("" if k not in PEERS else "-")
        cpu_ratio = f"{cpu / peer['cpu_ms']:.2f}x" if cpu and peer.get("cpu_ms") else ("" if k not in PEERS else "-")
        m = "ref" if k == "local" else {True: "yes", False: "no"}.get(match.get(k), "-")
        rows.append([RUNTIMES[k], "error" if k in errors and ms is None else ("-" if ms is None else f"{ms:,.1f}"),
                     ratio, "-" if cpu is None else f"{cpu:,.1f}", cpu_ratio,
                     "-" if "first_s" not in got else f"{got['first_s']:.2f}", m])
    return markdown(["runtime", "step ms", "/ torchrun", "CPU ms", "/ torchrun", "first step s", "losses match"],
                    rows, errors, RUNTIMES)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, RUNS, [k for k in RUNTIMES if k not in TORCHRUN])
    ap.add_argument("--steps", type=int, help=f"steps per timed loop (default {STEPS})")
    ap.add_argument("--layers", type=int, help=f"GPT blocks (default {LAYERS})")
    ap.add_argument("--no-tp", action="store_true", help="skip the {dp: 2, tp: 2} layouts (4 procs a side)")
    ap.add_argument("--fused", action="store_true", help="AdamW(fused=True) everywhere, and our compiled layouts")
    ap.add_argument("--only", choices=list(RUNTIMES), action="append", help="run only these runtimes")
    ap.add_argument("--torch-worker", choices=sorted(set(TORCHRUN.values())), help=argparse.SUPPRESS)
    args = ap.parse_args()
    g = globals()
    apply_common_args(args, g)
    for name in ("steps", "layers"):
        v = getattr(args, name)
        if v is not None:
            if v < 1:
                ap.error(f"--{name} must be >= 1, got {v}")
            g[name.upper()] = v
    if args.no_tp:
        g["NO_TP"] = True
    if args.fused:
        g["FUSED"] = True
    elif set(args.only or ()) & set(COMPILED):
        ap.error("the compiled layouts need --fused (compile replays no step of the default AdamW, which reads "
                 "its step count on the host)")
    if args.worker:
        worker(args.worker)
        return
    if args.torch_worker:
        report_rank(lambda res: torch_worker(args.torch_worker, res), MARKER, __file__)
        return

    settings = {k: g[k] for k in SETTINGS}
    kinds = [k for k in (args.only or RUNTIMES) if not (NO_TP and k in FOUR_PROCS) and (FUSED or k not in COMPILED)]
    if "local" not in kinds:
        kinds.insert(0, "local")  # the losses' reference
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    runs, errors = interleaved(kinds, RUNS, run_once, RUNTIMES, settings)
    median = {k: {key: statistics.median(r[key] for r in runs[k] if key in r)
                  for key in ("step_ms", "cpu_ms", "first_s") if any(key in r for r in runs[k])} for k in kinds}
    losses, match = loss_match(runs, kinds)
    tied = {k: next((r["tied"] for r in runs[k] if "tied" in r), None) for k in kinds}
    replays = {k: [r.get("replays") for r in runs[k]] for k in kinds if k in COMPILED}
    load = os.getloadavg()[0]
    print(f"\nmonarch-tensor train bench: GPT {LAYERS} layers x {N_EMBD} (tied embeddings), batch {BATCH} x {BLOCK} "
          f"in all, AdamW, {STEPS} steps a loop; median of {RUNS} run(s) x {REPEATS} loops "
          f"({time.perf_counter() - t0:.0f} s); default threads everywhere; {os.cpu_count()} CPUs, load average "
          f"{load0:.1f} at start, {load:.1f} at end\n")
    print(table(median, match, errors, kinds))
    print(f"\nlosses (first run; checked over the first {CHECK_STEPS} steps, tolerance {LOSS_TOL:g}):")
    for k, v in losses.items():
        if v is not None:
            note = "" if tied.get(k) in (True, None) else "  (lm_head.weight is no longer wte.weight)"
            print(f"  {RUNTIMES[k]:<28} {' '.join('%.5f' % x for x in v[:8])}{' ...' if len(v) > 8 else ''}{note}")
    for k, v in replays.items():  # (a step that was recorded each time would time recordings, not replays)
        print(f"  {RUNTIMES[k]}: {v} compiled replays a run (of {WARMUP + STEPS * REPEATS} steps)")
    if args.json:
        write_json(args.json, args.tiny, (load0, load), settings=settings, kinds=kinds, median=median, errors=errors,
                   losses=losses, loss_match=match, tied=tied, peers=PEERS, runs=runs, replays=replays)


if __name__ == "__main__":
    main()
