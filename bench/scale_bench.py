"""Scale of host agents: spawn time and broadcast latency vs procs (1-64) and local agents (1-8),
and a model projecting both to 1,024 hosts x 8 procs from the measured per-hop costs.

    .venv/bin/python bench/scale_bench.py                 # full sweep (a few minutes)
    .venv/bin/python bench/scale_bench.py --tiny          # smoke size (tests/test_bench_smoke.py)
    .venv/bin/python bench/scale_bench.py --json out.json

Agents are LocalJob agents (real processes, CURVE TCP, each its own zygote), so
"hosts" share this machine's cores: figures at many agents measure contention as
much as the protocol. What is measured, per row:

* spawn_s: ``spawn_procs`` + an actor on every proc + its first reply (agents warm).
* bcast_us: ``call()`` of a no-op endpoint on every proc, down the fan-out tree,
  every reply back to the controller (median of REPS).

The model (printed at the end) takes from the same run:

* hop_us: one extra agent hop (call_one to a proc behind an agent minus the same to a local proc),
* level_us: one more tree level (8 agents as a chain, fan-out 1, vs flat, fan-out 8, per level),
* reply_us: the controller's CPU per reply (slope of its process time per call() over procs on one
  agent; the wall-clock slope is printed too, but here it counts every proc sharing these cores),
* spawn_agent_s: the controller's cost per extra agent in a spawn (slope of spawn_s over agents),

and projects a broadcast to H hosts x P procs with fan-out F as
``hop_us + (depth(H, F) - 1) * level_us + H * P * reply_us`` (replies come straight
back, so the controller's share is O(procs), the send side is O(F)), and a spawn as
``spawn_s(P procs on 1 agent) + H * spawn_agent_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- settings --------------------------------------------------------------------------------
PROCS = [1, 2, 4, 8, 16, 32, 64]  # procs on one agent
AGENTS = [1, 2, 4, 8]  # agents, PER_AGENT procs each
PER_AGENT = 2
REPS = 15
TARGET = (1024, 8)  # hosts x procs per host in the projection
FANOUT = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    procs_sweep, agents_sweep, reps = (PROCS, AGENTS, REPS) if not args.tiny else ([1, 2], [1, 2], 3)

    from monarch_tensor import _fanout
    from monarch_tensor.actor import Actor, endpoint, this_host
    from monarch_tensor.job import LocalJob

    class Noop(Actor):
        @endpoint
        def ping(self) -> int:
            return 0

    def timed_calls(mesh, n, cpu: list | None = None) -> float:
        xs, cs = [], []
        for _ in range(n):
            t, c = time.perf_counter(), time.process_time()
            mesh.ping.call().get(timeout=120)
            xs.append((time.perf_counter() - t) * 1e6)
            cs.append((time.process_time() - c) * 1e6)
        if cpu is not None:
            cpu.append(statistics.median(cs))
        return statistics.median(xs)

    def spawn(hosts, per_host):
        t = time.perf_counter()
        procs = hosts.spawn_procs(per_host={"gpus": per_host})
        mesh = procs.spawn("noop", Noop)
        mesh.ping.call().get(timeout=300)
        return procs, mesh, time.perf_counter() - t

    rows: list = []
    res: dict = {"tiny": args.tiny, "rows": rows}
    job = LocalJob(meshes={"hosts": max(agents_sweep)}, ttl=300)
    try:
        all_hosts = job.state().hosts
        # Warm every agent's zygote (it imports torch once).
        p, _, _ = spawn(all_hosts, 1)
        p.stop().get(timeout=60)

        # hop_us: a proc behind an agent vs a proc of this host, same call.
        local = this_host().spawn_procs(per_host={"gpus": 1})
        lm = local.spawn("noop", Noop)
        lm.ping.call().get(timeout=120)
        p, m, _ = spawn(all_hosts.slice(hosts=0), 1)
        local_us, remote_us = timed_calls(lm, reps * 2), timed_calls(m, reps * 2)
        res["hop_us"] = max(0.0, remote_us - local_us)
        res["local_rtt_us"], res["agent_rtt_us"] = local_us, remote_us
        p.stop().get(timeout=60)
        local.stop().get(timeout=60)

        for n in procs_sweep:  # procs on one agent
            p, m, s = spawn(all_hosts.slice(hosts=0), n)
            cpu: list = []
            rows.append({"agents": 1, "procs": n, "fanout": FANOUT, "spawn_s": s, "bcast_us": timed_calls(m, reps, cpu),
                         "ctrl_cpu_us": cpu[0]})
            p.stop().get(timeout=60)
            _print(rows[-1])
        for fanout in (FANOUT, 1):
            _fanout.FANOUT = fanout
            for a in agents_sweep:
                if fanout == 1 and a != max(agents_sweep):
                    continue
                p, m, s = spawn(all_hosts.slice(hosts=slice(0, a)), PER_AGENT)
                rows.append({"agents": a, "procs": a * PER_AGENT, "fanout": fanout, "spawn_s": s,
                             "bcast_us": timed_calls(m, reps)})
                p.stop().get(timeout=60)
                _print(rows[-1])
        _fanout.FANOUT = FANOUT
    finally:
        job.kill()

    res["model"] = model(rows, res, agents_sweep, procs_sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _print(r: dict) -> None:
    if not getattr(_print, "done", False):
        print(f"{'agents':>6} {'procs':>5} {'fanout':>6} {'spawn_s':>8} {'bcast_us':>9} {'ctrl_cpu_us':>11}")
        _print.done = True
    cpu = f"{r['ctrl_cpu_us']:>11.0f}" if "ctrl_cpu_us" in r else f"{'':>11}"
    print(f"{r['agents']:>6} {r['procs']:>5} {r['fanout']:>6} {r['spawn_s']:>8.2f} {r['bcast_us']:>9.0f} {cpu}", flush=True)


def _slope(xs, ys) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den) if den else 0.0


def depth(hosts: int, fanout: int) -> int:
    """Agent hops from the controller to the farthest host of the tree in ``_fanout``."""
    from monarch_tensor._fanout import depth as tree_depth

    return tree_depth(hosts, fanout)


def model(rows, res, agents_sweep, procs_sweep) -> dict:
    one = [r for r in rows if r["agents"] == 1 and "ctrl_cpu_us" in r]
    reply_wall_us = _slope([r["procs"] for r in one], [r["bcast_us"] for r in one])
    # The controller's own CPU per reply: what bounds it on a real cluster, where procs do not share its cores.
    reply_us = _slope([r["procs"] for r in one], [r["ctrl_cpu_us"] for r in one])
    flat = [r for r in rows if r["fanout"] == FANOUT and r["procs"] == r["agents"] * PER_AGENT]
    spawn_agent_s = _slope([r["agents"] for r in flat], [r["spawn_s"] for r in flat])
    amax = max(agents_sweep)
    chain = next((r for r in rows if r["fanout"] == 1), None)
    wide = next((r for r in flat if r["agents"] == amax), None)
    level_us = max(0.0, (chain["bcast_us"] - wide["bcast_us"]) / (amax - 1)) if chain and wide and amax > 1 else 0.0
    hosts, per = TARGET
    d = depth(hosts, FANOUT)
    base = next((r for r in one if r["procs"] == min(per, max(procs_sweep))), one[-1])
    bcast_us = res["hop_us"] + (d - 1) * level_us + hosts * per * reply_us + res["local_rtt_us"]
    spawn_s = base["spawn_s"] + hosts * spawn_agent_s
    m = {"hop_us": res["hop_us"], "level_us": level_us, "reply_us": reply_us, "reply_wall_us": reply_wall_us,
         "spawn_agent_s": spawn_agent_s,
         "target": f"{hosts} hosts x {per} procs", "fanout": FANOUT, "depth": d,
         "bcast_us": bcast_us, "spawn_s": spawn_s}
    print(f"\nmeasured: local rtt {res['local_rtt_us']:.0f} us, via an agent {res['agent_rtt_us']:.0f} us "
          f"(hop {res['hop_us']:.0f} us); tree level {level_us:.0f} us; per reply {reply_us:.1f} us controller CPU "
          f"({reply_wall_us:.0f} us wall with every proc on these cores); "
          f"spawn per agent {spawn_agent_s * 1e3:.1f} ms")
    print(f"projected, {hosts} hosts x {per} procs, fan-out {FANOUT} (depth {d}): call() to all "
          f"{bcast_us / 1e3:.1f} ms (send side {(res['hop_us'] + (d - 1) * level_us) / 1e3:.2f} ms, "
          f"{hosts * per} replies {hosts * per * reply_us / 1e3:.1f} ms); spawn {spawn_s:.1f} s")
    return m


if __name__ == "__main__":
    main()
