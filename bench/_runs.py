"""What the side-by-side benchmarks share: every runtime in fresh processes, runs interleaved."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable


def interleaved(kinds: list[str], n_runs: int, run_once: Callable[[str, dict], dict], names: dict[str, str],
                settings: dict) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """``run_once(kind, settings)`` ``n_runs`` times per runtime, interleaved so that the machine's drift
    hits every runtime alike; a runtime that fails once is not run again. Returns (runs, errors)."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    errors: dict[str, str] = {}
    for i in range(n_runs):
        for kind in kinds:
            if kind in errors:
                continue
            t = time.perf_counter()
            res = run_once(kind, settings)
            runs[kind].append(res)
            if "error" in res:
                errors[kind] = res["error"]
            print(f"run {i + 1}/{n_runs} {names[kind]:<15} {time.perf_counter() - t:6.1f} s"
                  + (f"  ERROR {res['error'][:200]}" if "error" in res else ""), file=sys.stderr, flush=True)
    return runs, errors


def add_common_args(ap: argparse.ArgumentParser, runs: int, workers) -> None:
    """The options every side-by-side bench has; ``--worker``/``--settings`` are how it runs one runtime."""
    ap.add_argument("--tiny", action="store_true", help="every workload at a tiny size (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="write settings and results as JSON")
    ap.add_argument("--runs", type=int, help=f"fresh-process runs per runtime (default {runs})")
    ap.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)


def apply_common_args(args: argparse.Namespace, g: dict) -> None:
    """``--tiny`` (the module's TINY), a worker's ``--settings`` and ``--runs`` into the bench's globals ``g``."""
    if args.tiny:
        g.update(g["TINY"])
    if args.settings:
        g.update(json.loads(args.settings))
    if args.runs:
        g["RUNS"] = args.runs
