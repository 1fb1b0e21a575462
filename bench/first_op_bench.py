"""First-use benchmark: how long a fresh script's first sharded (DTensor) op takes on warm procs.

    python bench/first_op_bench.py                       # RUNS fresh scripts per side, WAIT s of other work
    python bench/first_op_bench.py --runs 3 --json bench/out/first_op_bench.json
    python bench/first_op_bench.py --runs 1 --wait 60     # a loaded machine imports slower: wait longer
    python bench/first_op_bench.py --tiny                # the smoke test's run (one side, no wait)

Each run is a fresh script (its own procs' template, nothing imported yet) that imports torch and
monarch_tensor, spawns PROCS procs, activates them and runs one plain op (``torch.ones(4) + 1``, fetched),
waits WAIT seconds (the script doing other work: the procs are warm), then times:

  first_s     ``distribute(arange(64).reshape(8, 8), mesh, ["gpus", None])``, ``dt @ dt.T`` and
              ``full_tensor()``: the script's first DTensor work, from its call until the value is here;
  second_s    the same again (``dt @ dt.T + 1``): the steady state.

Sides: "warm-up" (the default: procs are forked after their template imported what DTensor needs) and
"no warm-up" (``MONARCH_TENSOR_NO_WARMUP=1``: nothing imported ahead, as before the warm-up existed).
Runs are interleaved; the table shows medians. Absolute figures scale with the machine's load: compare
the two sides of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runs import add_common_args, apply_common_args, interleaved, launch, markdown, report_worker, write_json

# -----------------------------------------------------------------------------
RUNS = 3            # fresh scripts per side
PROCS = 2           # procs in the mesh ("gpus")
WAIT = 10.0         # seconds between the first plain op and the first DTensor op
TIMEOUT = 600.0     # seconds one run may take
KINDS = ["warm", "cold"]  # the sides to run (below)
TINY = dict(RUNS=1, WAIT=0.0, KINDS=["warm"])
# -----------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "FIRST_OP_RESULT "
SIDES = {"warm": "warm-up", "cold": "no warm-up"}
KEYS = ["setup_s", "first_s", "second_s"]


def measure(res: dict) -> None:
    """One fresh script's figures (runs in its own subprocess)."""
    t0 = time.perf_counter()
    import torch

    from monarch_tensor import distribute, fetch_shard, this_host

    procs = this_host().spawn_procs(per_host={"gpus": PROCS})
    try:
        with procs.activate():
            fetch_shard(torch.ones(4) + 1).result(timeout=TIMEOUT)
            res["setup_s"] = time.perf_counter() - t0
            time.sleep(WAIT)
            t = time.perf_counter()
            dt = distribute(torch.arange(64.0).reshape(8, 8), procs, sharding_spec=["gpus", None])
            first = (dt @ dt.T).full_tensor()
            res["first_s"] = time.perf_counter() - t
            t = time.perf_counter()
            second = (dt @ dt.T + 1).full_tensor()
            res["second_s"] = time.perf_counter() - t
        x = torch.arange(64.0).reshape(8, 8)
        if not (torch.equal(first, x @ x.T) and torch.equal(second, x @ x.T + 1)):
            res["error"] = "wrong values"
    finally:
        procs.stop().get(timeout=60)


def run_once(kind: str, settings: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MONARCH_TENSOR_NO_WARMUP", None)
    if kind == "cold":
        env["MONARCH_TENSOR_NO_WARMUP"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--settings", json.dumps(settings)]
    return launch(cmd, env, MARKER, TIMEOUT, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, RUNS, SIDES)
    ap.add_argument("--wait", type=float, help=f"seconds between the first plain op and the first DTensor op "
                                               f"(default {WAIT:g})")
    args = ap.parse_args()
    apply_common_args(args, globals())
    if args.wait is not None and not args.worker:
        globals()["WAIT"] = args.wait
    if args.worker:
        report_worker(measure, MARKER, __file__)
    settings = {"RUNS": RUNS, "PROCS": PROCS, "WAIT": WAIT}
    load0 = os.getloadavg()[0]
    runs, errors = interleaved(KINDS, RUNS, run_once, SIDES, settings)
    median = {k: {key: statistics.median(r[key] for r in rs) for key in KEYS if rs and all(key in r for r in rs)}
              for k, rs in runs.items()}
    rows = [[SIDES[k]] + [f"{median[k][key]:.2f}" if key in median[k] else "error" for key in KEYS] for k in KINDS]
    print(f"\nfirst DTensor op of a fresh script, {PROCS} procs, {WAIT:g} s after the first plain op "
          f"(medians of {RUNS} runs; load average {load0:.1f} -> {os.getloadavg()[0]:.1f})\n")
    print(markdown(["side", "spawn+first plain op s", "first distribute+op+full_tensor s", "second s"], rows,
                   errors, SIDES))
    if args.json:
        write_json(args.json, args.tiny, (load0, os.getloadavg()[0]), settings=settings, runs=runs, median=median,
                   errors=errors)


if __name__ == "__main__":
    main()
