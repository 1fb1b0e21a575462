"""What the side-by-side benchmarks share: every runtime in fresh processes, runs interleaved."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
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


def launch(cmd: list[str], env: dict, marker: str, timeout: float, cwd: str) -> dict:
    """Run one runtime's ``cmd`` in its own session; its result is the dict on a ``marker`` line of its stdout
    (the first one with an "error", else the last), or ``{"error": ...}`` when it timed out or printed none.
    Whatever the runtime left running in its session is killed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True, cwd=cwd)
    timed_out = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(p.pid, signal.SIGKILL)  # the whole group: the runtime's procs, ranks or daemons too
        out, err = p.communicate(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # procs a runtime left behind
    results = [json.loads(ln[len(marker):]) for ln in out.splitlines() if ln.startswith(marker)]
    res = next((r for r in results if "error" in r), results[-1] if results else {})
    if timed_out:
        res.setdefault("error", f"timed out after {timeout:.0f} s")
    elif not results:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        res["error"] = f"exit code {p.returncode}: {tail}"
    return res


def error_text(e: BaseException, script: str) -> str:
    """``e`` in one line, with the line of ``script`` (a bench's own file) it came from, if any."""
    import traceback

    ours = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == os.path.abspath(script)]
    return f"{type(e).__name__}: {e}" + (f" ({os.path.basename(script)}:{ours[-1].lineno})" if ours else "")


def report_worker(measure: Callable[[dict], object], marker: str, script: str) -> None:
    """Body of one runtime's fresh subprocess: ``measure(res)``, then ``res`` (or its error) as one ``marker``
    line, and exit at once (a runtime's leftover threads must not keep the subprocess alive)."""
    import traceback

    res: dict = {}
    try:
        measure(res)
    except BaseException as e:  # noqa: BLE001 - reported in the table
        res["error"] = error_text(e, script)
        traceback.print_exc()
    finally:
        print(marker + json.dumps(res), flush=True)
        sys.stdout.flush()
        os._exit(0)


def report_rank(measure: Callable[[dict], int], marker: str, script: str) -> None:
    """Body of one rank of a torchrun launch: ``measure(res)`` returns the rank; rank 0's ``res``, or any rank's
    error, goes out as one ``marker`` line, and the rank exits (1 on an error)."""
    import traceback

    res: dict = {}
    rank = int(os.environ.get("RANK", "0"))
    try:
        rank = measure(res)
    except BaseException as e:  # noqa: BLE001 - reported in the table
        res["error"] = f"rank {rank}: " + error_text(e, script)
        traceback.print_exc()
    if rank == 0 or "error" in res:
        print(marker + json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(1 if "error" in res else 0)


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) used so far by process ``pid`` (default: this one) and every
    live process below it: a controller and the procs it spawned. Linux's /proc; elsewhere this process only."""
    pid = os.getpid() if pid is None else pid
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats: dict[int, tuple[int, float]] = {}  # pid: (parent, cpu s)
    try:
        names = os.listdir("/proc")
    except OSError:
        return time.process_time()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime stime
        except OSError:  # gone meanwhile
            continue
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for p, (parent, _) in stats.items():
        children.setdefault(parent, []).append(p)
    me = os.getpid()
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += time.process_time() if p == me else stats.get(p, (0, 0.0))[1]  # (this one to the ns, not the tick)
        todo += children.get(p, [])
    return total


def timed_training(step: Callable, batches, wait: Callable, warmup: int, steps: int, repeats: int,
                   barrier: Callable = lambda: None, cpu: Callable[[], float] | None = None) -> dict:
    """A training loop's timings: the first step alone (issued, then ``wait``ed for), ``warmup - 1`` more
    untimed steps, then ``repeats`` loops of ``steps`` steps, each loop ending when ``wait(its last loss)``
    returns. ``step(x, y)`` issues one step and returns its loss (whatever the runtime's loss is); ``batches``
    yields ``(x, y)``. Returns ``first_s``, ``loops_ms`` (per step), ``step_ms`` (their median) and ``losses``
    (every step's loss object, in order, for the caller to turn into numbers outside the timed region); with
    ``cpu`` (CPU seconds used so far by every process of the runtime), also ``cpu_loops_ms`` and ``cpu_ms``:
    the CPU time a step costs, which other work on the machine does not inflate as it does wall time."""
    import statistics

    it = iter(batches)
    barrier()
    t = time.perf_counter()
    losses = [step(*next(it))]
    wait(losses[0])
    first = time.perf_counter() - t
    losses += [step(*next(it)) for _ in range(max(0, warmup - 1))]
    wait(losses[-1])
    loops, cpu_loops = [], []
    for _ in range(repeats):
        barrier()
        c = cpu() if cpu else 0.0
        t = time.perf_counter()
        for _ in range(steps):
            losses.append(step(*next(it)))
        wait(losses[-1])
        loops.append((time.perf_counter() - t) * 1e3 / steps)
        if cpu:
            barrier()
            cpu_loops.append((cpu() - c) * 1e3 / steps)
    out = {"first_s": first, "loops_ms": loops, "step_ms": statistics.median(loops), "losses": losses}
    if cpu:
        out.update(cpu_loops_ms=cpu_loops, cpu_ms=statistics.median(cpu_loops))
    return out


def write_json(path: str, tiny: bool, load: tuple[float, float], **results) -> None:
    """``results`` and the machine they were measured on (load average at the start and the end) to ``path``."""
    import datetime
    import platform

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "tiny": tiny,
           "loadavg_start": load[0], "loadavg_end": load[1]}
    with contextlib.suppress(ImportError):
        import torch

        env["torch"] = torch.__version__
    with open(path, "w") as f:
        json.dump({"settings": results.pop("settings"), "env": env, **results}, f, indent=1)


def markdown(head: list[str], rows: list[list[str]], errors: dict[str, str], names: dict[str, str]) -> str:
    """A markdown table (first column left-aligned, the rest right-aligned), then each runtime's error."""
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    out += [f"{names[k]}: {e}" for k, e in errors.items()]
    return "\n".join(out)
