"""Regression guard: the actor and dispatch benchmarks of the working tree against other revisions, in turns.

    python bench/compare.py 2f193bf                    # working tree against one revision
    python bench/compare.py main HEAD~5 --runs 5       # against two, 5 fresh-process runs each
    python bench/compare.py main --bench actor --floor # the actor bench only, with the raw zmq floor
    python bench/compare.py HEAD --tiny                # smoke test

Each REV is checked out into a scratch worktree (``git worktree add --detach``, removed at the end) and
byte-compiled; a revision whose library does not import is reported and left out. Every run is one
fresh subprocess of this working tree's bench script (the same workloads and settings for all) with
``PYTHONPATH`` pointing at one tree's library, so only the library differs. The runs are interleaved
(working tree, REV1, REV2, ..., then again) so the machine's drift hits all alike. The tables show the
median over runs and, per revision, "work vs REV": how many times better the working tree is (>1: better,
<1: a regression). The CPU rows (CPU µs per pipelined call, all threads) move less with the machine's
load than the wall-clock ones: read them first on a busy machine. Not a timed test: a tool to run before
and after a change to the message path. --json PATH writes every run's raw numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import actor_bench  # bench/ is on sys.path; only their settings, workloads and markers
import dispatch_bench
from _runs import interleaved, launch, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
WORK = "work"  # the working tree's name in the tables
BENCHES = {"actor": actor_bench, "dispatch": dispatch_bench}


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def build(rev: str, scratch: str) -> str:
    """A scratch worktree of ``rev`` under ``scratch``, byte-compiled; its path."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = os.path.join(scratch, sha[:10])
    if not os.path.exists(path):
        git("worktree", "add", "--detach", path, sha)
        subprocess.run([sys.executable, "-m", "compileall", "-q", path], capture_output=True, timeout=300)
    return path


def check_import(tree: str) -> str | None:
    """None when ``tree``'s library is the one imported with it on PYTHONPATH, else why not."""
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.run([sys.executable, "-c", "import monarch_tensor.actor as a; print(a.__file__)"],
                       capture_output=True, text=True, env=env, cwd=tree, timeout=120)
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or ["no output"])[-1]
    got = p.stdout.strip()
    if not os.path.realpath(got).startswith(os.path.realpath(tree) + os.sep):
        return f"imports {got}, not the tree's library (an installed copy shadows PYTHONPATH)"
    return None


def runner(bench, trees: dict[str, str]):
    """``run_once(kind, settings)`` for ``interleaved``: kind is a tree's name (or "floor", the actor bench's
    zmq floor), run as the bench's "ours" worker with that tree's library."""
    script = os.path.join(HERE, os.path.basename(bench.__file__))

    def run_once(kind: str, settings: dict) -> dict:
        tree = trees.get(kind, ROOT)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, script, "--worker", "floor" if kind == "floor" else "ours",
               "--settings", json.dumps(settings)]
        return launch(cmd, env, bench.MARKER, bench.RUN_TIMEOUT, tree)

    return run_once


def rows_of(name: str):
    """(key, label, unit, higher_is_better) of every row of bench ``name``."""
    if name == "actor":
        return [(k, label, unit, higher) for k, label, unit, higher, _ in actor_bench.workloads()]
    return [(k, label, unit, False) for k, label, unit in dispatch_bench.WORKLOADS]


def fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "/s":
        return f"{v:,.0f} /s"
    if unit == "µs":
        return f"{v:,.1f} µs" if v < 100 else f"{v:,.0f} µs"
    return f"{v:,.2f} {unit}"


def table(name: str, med: dict, kinds: list[str], errors: dict, labels: dict) -> str:
    revs = [k for k in kinds if k not in (WORK, "floor")]
    head = ["workload"] + [labels[k] for k in kinds] + [f"work vs {labels[r]}" for r in revs]
    rows = []
    floor_keys = {k: f for k, _, _, _, f in actor_bench.workloads()} if name == "actor" else {}
    for key, label, unit, higher in rows_of(name):
        if not any(key in med.get(k, {}) for k in kinds if k != "floor"):
            continue
        vals = {k: med.get(k, {}).get(floor_keys.get(key) if k == "floor" else key) for k in kinds}
        row = [label] + [fmt(vals[k], unit) if k != "floor" or floor_keys.get(key) else "" for k in kinds]
        for r in revs:
            w, o = vals[WORK], vals[r]
            row.append(f"{(w / o if higher else o / w):.2f}x" if w and o else "-")
        rows.append(row)
    return markdown(head, rows, errors, labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs="+", metavar="REV", help="revisions to compare the working tree with")
    ap.add_argument("--bench", choices=list(BENCHES), action="append", help="only these benches (default: both)")
    ap.add_argument("--runs", type=int, default=3, help="fresh-process runs per tree and bench (default 3)")
    ap.add_argument("--floor", action="store_true", help="also run the actor bench's raw zmq floor in the turns")
    ap.add_argument("--tiny", action="store_true", help="every workload at a tiny size (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="write settings, medians and every run's numbers as JSON")
    args = ap.parse_args()

    scratch = tempfile.mkdtemp(prefix="mt-compare-")
    trees, labels, out = {WORK: ROOT}, {WORK: "work", "floor": "zmq floor"}, {}
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    try:
        for rev in args.revs:
            path = build(rev, scratch)
            label = f"{rev} ({os.path.basename(path)[:7]})" if not rev.startswith(os.path.basename(path)[:7]) else rev
            why = check_import(path)
            if why:
                print(f"{rev}: left out, its library does not import: {why}", file=sys.stderr)
                continue
            trees[rev], labels[rev] = path, label
        # the library's byte code written before the first timed run, as for the revisions (an import alone
        # writes none where PYTHONDONTWRITEBYTECODE is set, and every process then compiles new modules again)
        subprocess.run([sys.executable, "-m", "compileall", "-q"]
                       + [os.path.join(ROOT, d) for d in ("monarch_tensor", "controller", "worker", "rdma")],
                       capture_output=True, timeout=300)
        why = check_import(ROOT)
        if why:
            raise SystemExit(f"the working tree's library does not import: {why}")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        labels[WORK] = f"work ({git('rev-parse', '--short', 'HEAD')}{'+' if dirty else ''})"
        for name in args.bench or list(BENCHES):
            bench = BENCHES[name]
            settings = {k: getattr(bench, k) for k in bench.SETTINGS}
            if args.tiny:
                for k, v in bench.TINY.items():  # (the module's too: its rows' labels read them)
                    setattr(bench, k, v)
                    if k in settings:
                        settings[k] = v
            kinds = list(trees) + (["floor"] if args.floor and name == "actor" else [])
            print(f"{name} bench: {args.runs} run(s) of {', '.join(labels[k] for k in kinds)}", file=sys.stderr)
            runs, errors = interleaved(kinds, args.runs, runner(bench, trees), labels, settings)
            med = {k: {key: statistics.median(r[key] for r in runs[k] if key in r)
                       for key in {key for r in runs[k] for key, v in r.items() if isinstance(v, (int, float))}}
                   for k in kinds}
            out[name] = {"settings": settings, "median": med, "errors": errors, "runs": runs}
            load = os.getloadavg()
            print(f"\n{name} bench, median of {args.runs} fresh-process run(s) per tree; work vs REV: how many "
                  f"times better the working tree is (>1: better); load average {load[0]:.2f} "
                  f"({os.cpu_count()} CPUs){' [TINY]' if args.tiny else ''}\n")
            print(table(name, med, kinds, errors, labels), flush=True)
    finally:
        for path in trees.values():
            if path != ROOT:
                with contextlib.suppress(subprocess.SubprocessError):
                    git("worktree", "remove", "--force", path)
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(subprocess.SubprocessError):
            git("worktree", "prune")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, load average {load0[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"trees": {k: labels[k] for k in trees}, "loadavg_start": load0[0],
                       "loadavg_end": os.getloadavg()[0], "tiny": args.tiny, **out}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
