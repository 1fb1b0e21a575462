"""Data-parallel training steps: gradients reduced after the backward pass, or as it produces them
(``grad_generator`` + a communication stream), against PyTorch's DistributedDataParallel.

    python bench/ddp_bench.py                                  # ours (both ways) and DDP under torchrun
    python bench/ddp_bench.py --runs 3 --json bench/out/ddp_bench.json
    python bench/ddp_bench.py --tiny --json /tmp/tiny.json     # smoke test (~30 s)

The workload (PROCS ranks, THREADS torch thread(s) each, the same weights, data and schedule everywhere): an
MLP of LAYERS layers ``h = tanh(h @ w + b)`` (WIDTH x WIDTH), loss ``h.square().mean()`` on a BATCH x WIDTH
input that differs per rank (rank r's is (1 + r) times the same draw), plain SGD (``p -= LR * grad``) on
the gradients averaged over the ranks. WARMUP steps, then REPEATS loops of STEPS steps, each loop ending
when the last loss is on the controller (rank 0's); ms per step is the median of the loops.

Runtimes, each in fresh processes, runs interleaved:
  ours after     one script drives a mesh of PROCS procs: ``loss.backward()``, then ``p.grad.reduce_("dp",
                 "avg")`` for every parameter, on the default stream (the controller folds the run of
                 reduces into one collective where no flush falls between them)
  ours bucket    the same, but ``reduce_([p.grad for p in params], "dp", "avg")``: one collective for every
                 gradient (their elements side by side in one buffer, as DDP's buckets)
  ours overlap   the same mesh and script (the ways alternate loop by loop, each on its own copy of the
                 weights): ``grad_generator(loss, params in gradient_execution_order)``, each gradient
                 borrowed by a "comm" stream and reduced there as it comes (a worker runs each stream on a
                 thread of its own), the borrows dropped before the SGD step
  ddp            ``torchrun --nproc_per_node PROCS``: the same model as an ``nn.Module`` in
                 ``DistributedDataParallel`` (gloo, its default buckets: it all-reduces buckets as the
                 backward fills them), ``torch.optim.SGD``; rank 0's timings
The losses at the loops' ends are printed for every runtime, and checked equal (the same training).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _runs import (  # noqa: E402
    add_common_args,
    apply_common_args,
    interleaved,
    markdown,
    report_rank,
    report_worker,
    write_json,
)
from _runs import launch as run_launch  # noqa: E402

# ---- settings ------------------------------------------------------------------------------
PROCS = 2
THREADS = 1
LAYERS = 8
WIDTH = 512
BATCH = 64
LR = 0.05
SEED = 0
WARMUP = 3
STEPS = 5
REPEATS = 5
RUNS = 2
RUN_TIMEOUT = 600.0
LOSS_RTOL = 1e-4
TINY = dict(LAYERS=2, WIDTH=32, BATCH=4, WARMUP=1, STEPS=2, REPEATS=2, RUNS=1)
SETTINGS = ["PROCS", "THREADS", "LAYERS", "WIDTH", "BATCH", "LR", "SEED", "WARMUP", "STEPS", "REPEATS"]
MARKER = "DDP_BENCH_RESULT "
RUNTIMES = {"ours": "ours", "ddp": "DDP (torchrun)"}
WAYS = ("after", "bucket", "overlap")
WORKLOADS = [("after_ms", "ours: p.grad.reduce_ per parameter"), ("bucket_ms", "ours: one reduce_ of every gradient"),
             ("overlap_ms", "ours: grad_generator + comm stream"), ("ddp_ms", "DDP, gloo")]


# ---- the workload, shared by every runtime (the first two also run on the workers) ------------
def make_params(seed: int, layers: int, width: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        out += [torch.randn(width, width, generator=g) / math.sqrt(width), torch.zeros(width)]
    return out


def make_input(seed: int, batch: int, width: int):
    import torch

    return torch.randn(batch, width, generator=torch.Generator().manual_seed(seed + 1))


def forward(params: list, x):
    import torch

    h = x
    for i in range(0, len(params), 2):
        h = torch.tanh(h @ params[i] + params[i + 1])
    return h.square().mean()


def warm(step, sync, steps: int) -> None:
    loss = None
    for _ in range(steps):
        loss = step()
    if loss is not None:
        sync(loss)


def timed_loop(step, sync) -> tuple[float, float]:
    """One loop of STEPS steps, until the last loss is here: (ms per step, that loss)."""
    t = time.perf_counter()
    for _ in range(STEPS):
        loss = step()
    value = sync(loss)
    return (time.perf_counter() - t) * 1e3 / STEPS, value


# ---- ours ---------------------------------------------------------------------------------
def measure_ours(res: dict) -> None:
    import torch

    from monarch_tensor import Stream, fetch_shard, grad_generator, reduce_, remote
    from monarch_tensor.actor import this_host
    from monarch_tensor.gradient_generator import gradient_execution_order

    procs = this_host().spawn_procs(per_host={"dp": PROCS})
    res["losses"] = {way: [] for way in WAYS}
    try:
        with procs.activate():
            remote("torch.set_num_threads", propagate=lambda n: None)(THREADS)
            shapes = [(WIDTH, WIDTH), (WIDTH,)] * LAYERS
            init = remote(make_params, propagate=lambda s, n, w: [torch.empty(sh) for sh in shapes])
            x = remote(make_input, propagate=lambda s, b, w: torch.empty(b, w))(SEED, BATCH, WIDTH)
            x = x * (1 + procs.rank_tensor("dp"))
            params = {way: [p.requires_grad_(True) for p in init(SEED, LAYERS, WIDTH)] for way in WAYS}
            comm = Stream("comm")

            def sgd(ps):
                with torch.no_grad():
                    for p in ps:
                        p.sub_(p.grad * LR)
                        p.grad = None

            def after():
                ps = params["after"]
                loss = forward(ps, x)
                loss.backward()
                for p in ps:
                    p.grad.reduce_("dp", "avg")
                sgd(ps)
                return loss

            def bucket():
                ps = params["bucket"]
                loss = forward(ps, x)
                loss.backward()
                reduce_([p.grad for p in ps], "dp", "avg")  # one collective for every gradient
                sgd(ps)
                return loss

            def overlap():
                ps = params["overlap"]
                loss = forward(ps, x)
                order = gradient_execution_order([loss], ps)
                borrows = []
                for i, g in zip(order, grad_generator(loss, [ps[i] for i in order])):
                    on_comm, borrow = comm.borrow(g, mutable=True)
                    with comm.activate():
                        on_comm.reduce_("dp", "avg")
                    borrows.append(borrow)
                    ps[i].grad = g
                for b in borrows:
                    b.drop()
                sgd(ps)
                return loss

            def sync(loss):
                return float(fetch_shard(loss.detach(), dp=0).result(timeout=RUN_TIMEOUT))

            ways = {"after": after, "bucket": bucket, "overlap": overlap}
            for fn in ways.values():
                warm(fn, sync, WARMUP)
            times: dict = {way: [] for way in WAYS}
            for _ in range(REPEATS):  # the two ways alternate loop by loop: the machine's drift hits both alike
                for way, fn in ways.items():
                    ms, loss = timed_loop(fn, sync)
                    times[way].append(ms)
                    res["losses"][way].append(loss)
            for way in WAYS:
                res[f"{way}_ms"] = statistics.median(times[way])
    finally:
        procs.stop().get(timeout=RUN_TIMEOUT)


# ---- DDP (one rank of a torchrun launch) ------------------------------------------------------
def ddp_worker(res: dict) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(THREADS)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(make_params(SEED, LAYERS, WIDTH))

        def forward(self, x):
            return forward(list(self.ps), x)

    model = torch.nn.parallel.DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = make_input(SEED, BATCH, WIDTH) * (1 + rank)
    res["losses"] = {"ddp": []}

    def step():
        loss = model(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    dist.barrier()
    warm(step, float, WARMUP)
    times = []
    for _ in range(REPEATS):
        ms, loss = timed_loop(step, float)
        times.append(ms)
        res["losses"]["ddp"].append(loss)
    res["ddp_ms"] = statistics.median(times)
    dist.barrier()
    dist.destroy_process_group()
    return rank


# ---- orchestration ------------------------------------------------------------------------------
def worker(kind: str) -> None:
    def measure(res: dict) -> None:
        import torch

        torch.set_num_threads(THREADS)
        measure_ours(res)

    report_worker(measure, MARKER, __file__)


def run_once(kind: str, settings: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = str(THREADS)
    me = [os.path.abspath(__file__), "--settings", json.dumps(settings)]
    if kind == "ours":
        cmd = [sys.executable] + me + ["--worker", "ours"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCS}"] + me + [
            "--ddp-worker"]
    return run_launch(cmd, env, MARKER, RUN_TIMEOUT, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, RUNS, ["ours"])
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    g = globals()
    apply_common_args(args, g)
    if args.worker:
        worker(args.worker)
        return
    if args.ddp_worker:
        report_rank(ddp_worker, MARKER, __file__)
        return

    settings = {k: g[k] for k in SETTINGS}
    kinds = list(RUNTIMES)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    runs, errors = interleaved(kinds, RUNS, run_once, RUNTIMES, settings)
    keys = [w[0] for w in WORKLOADS]
    median = {key: statistics.median(r[key] for k in kinds for r in runs[k] if key in r)
              for key in keys if any(key in r for k in kinds for r in runs[k])}
    losses = {}
    for k in kinds:
        for r in runs[k]:
            for way, v in r.get("losses", {}).items():
                losses.setdefault(way, v)
    ref = losses.get("ddp")
    match = {way: ref is not None and len(v) == len(ref) and all(
        math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=1e-7) for a, b in zip(v, ref))
        for way, v in losses.items() if way != "ddp"}
    load = os.getloadavg()[0]
    print(f"\nmonarch-tensor DDP bench: {PROCS} ranks x {THREADS} torch thread(s), MLP {LAYERS} x {WIDTH}, batch "
          f"{BATCH}, {STEPS} steps a loop; median of {RUNS} run(s) x {REPEATS} loops "
          f"({time.perf_counter() - t0:.0f} s); {os.cpu_count()} CPUs, load average {load0:.1f} at start, "
          f"{load:.1f} at end\n")
    base = median.get("ddp_ms")
    rows = [[label, "-" if key not in median else f"{median[key]:,.1f} ms",
             f"{median[key] / base:.2f}x" if key in median and base else "-"] for key, label in WORKLOADS]
    for way in ("bucket", "overlap"):
        if "after_ms" in median and f"{way}_ms" in median:
            rows.append([f"{way} / after (same runs)", f"{median[f'{way}_ms'] / median['after_ms']:.2f}x", ""])
    print(markdown(["workload", "ms per step", "/ DDP"], rows, errors, RUNTIMES))
    print("\nlosses at the loops' ends (first run):")
    for way, v in losses.items():
        print(f"  {way:<8} {' '.join('%.6f' % x for x in v)}")
    print(f"  match DDP (rtol {LOSS_RTOL:g}): " + ", ".join(f"{w} {m}" for w, m in match.items()))
    if args.json:
        write_json(args.json, args.tiny, (load0, load), settings=settings, workloads=keys, median=median,
                   errors=errors, losses=losses, loss_match=match, runs=runs)


if __name__ == "__main__":
    main()
