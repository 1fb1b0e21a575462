"""Scale of host agents: controller CPU per call() and per spawn, and latency, vs procs (1-64) and local agents
(1-8), replies gathered up the agent tree against replies sent straight back, and a model projecting both to
1,024 hosts x 8 procs from the measured per-hop and per-message costs.

    .venv/bin/python bench/scale_bench.py                 # full sweep (a few minutes)
    .venv/bin/python bench/scale_bench.py --tiny          # smoke size (tests/test_bench_smoke.py)
    .venv/bin/python bench/scale_bench.py --json out.json

Agents are LocalJob agents (real processes, CURVE TCP, each its own zygote), so
"hosts" share this machine's cores: figures at many agents measure contention as
much as the protocol. What is measured, per row (each mesh is spawned once and called in both modes, in
turns: ``gather``, replies up the tree in chunks, ``_fanout.GATHER``; ``direct``, each reply on its own):

* spawn_s, spawn_cpu_ms: ``spawn_procs`` + an actor on every proc + its first reply (agents warm): wall
  clock, and the controller's CPU time (its process time: every thread of it).
* chunks: the messages up the tree the controller received per gathered call (one per root agent, more where
  an agent's window, MONARCH_TENSOR_GATHER_WINDOW_MS, sent part of its subtree's replies ahead of a straggler),
* {gather,direct}_us: ``call()`` of a no-op endpoint on every proc, down the fan-out tree, every reply back
  (median of REPS); fold_us: ``Accumulator(ping, 0, max).accumulate()`` of the same replies, folded in the
  agents (``fold`` mode); *_cpu_us: the controller's CPU time per such call (its threads do not spin-poll while
  they wait here, so this is the work it does).

The model (printed at the end) takes from the same run:

* hop_us: one extra agent hop (call_one to a proc behind an agent minus the same to a local proc),
* level_us: one more tree level (8 agents as a chain, fan-out 1, vs flat, fan-out 8, per level; gathered
  replies climb the chain too, so it counts both ways),
* entry_us: the controller's CPU per gathered reply, raw (slope of its CPU per call() over 2-64 procs on one
  agent, each count of procs up alone; a call() to one proc is not gathered),
* equal_load: on the largest one-agent mesh, calls in turns with the same procs up (``equal_load()``): to all of
  them, to SLICE of them (``entry_slice_us``: the slope between the two), a broadcast() to the rest with a
  call() to the SLICE, so that the same procs work and only the replies the controller reads differ
  (``entry_work_us``: call() to all less that, plus the broadcast's own CPU timed alone, per reply), the call
  to all folded in the agent (``entry_fold_us``: the gathered call less the folded one, per proc: the same
  procs, agent and tree, and the controller reads every value or one run), and the SLICE's call with one
  CPU-bound process beside the controller (``burner_us``: what that load alone adds to it),
* chunk_us: the controller's CPU per agent it sends to and hears a chunk from (slope of its CPU per call()
  over agents, flat tree, less that agent's procs' entries),
* agent_level_us: an agent's CPU for one call at one level (``_gather.Gathers`` timed in this process: P
  replies of its own procs, F children's chunks of H*P/F replies each, its own chunk sent),
* controller_entry_us: the controller's CPU per rank of a gathered call() alone in this process
  (``controller_entry``: the call on a mesh of 4,096 procs, its sends left out, and a root's chunk of their
  replies nested as the tree sends it, read and handed to its port), beside the live figures, which on a
  small machine also count the procs' share of its cores,
* reply_us: with replies sent straight back, the controller's CPU per reply (the slope as entry_us),
* spawn_agent_ms: the controller's CPU per extra agent in a spawn (slope of spawn_cpu_ms over agents, flat
  tree; the spawn goes down the tree of agents, ``_spawn_tree``, so this is its own bookkeeping per agent),
* idle_pct: the controller's CPU per second of wall clock while it waits with that row's mesh up (its
  threads serve the procs' own traffic meanwhile), in %; the gathered call's slopes are printed again net of
  it (``net_*``: CPU minus idle_pct x that call's wall time); idle_cpu_rate: the same with no procs up,
  which the spawn's slope is taken net of,
* spawn_level_s: one more tree level in a spawn (8 agents as a chain vs flat, per level, wall clock),
* spawn_plan: the controller's CPU to plan a spawn on H x P procs and encode its requests to the root agents
  (``ctl_ms``), and a root agent's CPU to read its request and pass each child its part (``agent_ms``), in this
  process at the target size,

* agent_fold_level_us: an agent's CPU for one folded call at one level (P plain replies folded, F children's
  chunks of 3 runs merged), controller_fold_us: the controller's CPU to read one chunk per root agent (depth
  runs each) for H*P procs and finish the fold, its per-rank lists and FoldCollector made; send_ctl_us: the
  controller's CPU in ``_fanout.send_many`` for H*P procs, its sends left out (the tree's plans are built on
  the first call to a set of procs and reused after: ``first``, ``next``), all in this process,

and projects a gathered call() to H hosts x P procs with fan-out F, depth d, as
``rtt + hop_us + (d - 1) * level_us + d * agent_level_us + min(H, F) * chunk_us + H * P * e +
send_ctl_us["next"]`` with ``e = max(entry_fold_us, read) + call`` (``read``, ``call``: controller_entry_us's
parts; the send side and the chunks are O(F) at the controller; it still unpickles each value: the cost of
reading a reply with the machine's load held equal, never less than timed alone, and the call's own per-rank
CPU, which a folded call pays too; the call is printed again with the raw slope, entry_us, in place of e,
and with controller_entry_us), the same call with direct
replies as ``rtt + hop_us + (d - 1) * level_us + H * P * reply_us``, a folded one as ``rtt + hop_us + (d - 1) * level_us
+ d * agent_fold_level_us + min(H, F) * chunk_us + controller_fold_us + send_ctl_us["next"]``, and a spawn as
``spawn_s(P procs on 1 agent) + (d - 1) * spawn_level_s + d * spawn_plan["agent_ms"] + H * spawn_agent_ms`` (the
controller sends one request per root agent; each level forks its procs and passes the spawn on at once).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- settings --------------------------------------------------------------------------------
PROCS = [1, 2, 4, 8, 16, 32, 64]  # procs on one agent
AGENTS = [1, 2, 4, 8]  # agents, PER_AGENT procs each
PER_AGENT = 2
SLICE = 2  # procs of the largest one-agent mesh called in the equal-load comparison
REPS = 15
TARGET = (1024, 8)  # hosts x procs per host in the projection
FANOUT = 8
MODES = ("gather", "direct", "fold")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    procs_sweep, agents_sweep, reps = (PROCS, AGENTS, REPS) if not args.tiny else ([1, 2, 4], [1, 2], 3)

    # The controller blocks while it waits (no spin-polling): its CPU time is then the work it does. Only it:
    # the variable is gone again before any agent or proc starts.
    os.environ["MONARCH_TENSOR_SPIN_US"] = "0"
    from monarch_tensor.actor import Accumulator, Actor, endpoint, this_host
    from monarch_tensor.job import LocalJob
    from monarch_tensor.transport import _fanout

    del os.environ["MONARCH_TENSOR_SPIN_US"]
    from monarch_tensor.transport import mailbox

    up_messages = [0]  # messages up the tree this process received (chunks, messages passed up)
    up_entries = mailbox.Mailbox._up_entries

    def counted(self, frames):
        up_messages[0] += 1
        return up_entries(self, frames)

    mailbox.Mailbox._up_entries = counted

    class Noop(Actor):
        @endpoint
        def ping(self) -> int:
            return 0

    def timed_calls(mesh, n, mode: str = "gather") -> tuple[float, float]:
        """Median wall-clock and controller CPU µs of a call() to every proc of ``mesh`` (mode "fold": an
        ``Accumulator`` with ``max`` of the same replies, folded in the agents)."""
        xs, cs = [], []
        acc = Accumulator(mesh.ping, 0, max)
        for _ in range(n):
            t, c = time.perf_counter(), time.process_time()
            if mode == "fold":
                assert acc.accumulate().get(timeout=120) == 0
            else:
                mesh.ping.call().get(timeout=120)
            xs.append((time.perf_counter() - t) * 1e6)
            cs.append((time.process_time() - c) * 1e6)
        return statistics.median(xs), statistics.median(cs)

    def both(mesh, n) -> dict:
        """The call in every mode, in turns (REPS rounds of a few calls each), medians of each; ``chunks``: the
        messages up the tree the controller received per gathered call (mean)."""
        got: dict = {m: ([], []) for m in MODES}
        chunks = calls = 0
        for _ in range(max(1, n // 3)):
            for mode in MODES:
                _fanout.GATHER = mode != "direct"
                before = up_messages[0]
                w, c = timed_calls(mesh, 3, mode)
                if mode == "gather":
                    chunks, calls = chunks + up_messages[0] - before, calls + 3
                got[mode][0].append(w)
                got[mode][1].append(c)
        _fanout.GATHER = True
        out = {"chunks": chunks / max(1, calls)}
        for mode, (w, c) in got.items():
            out[f"{mode}_us"], out[f"{mode}_cpu_us"] = statistics.median(w), statistics.median(c)
        return out

    def equal_load(mesh, n: int, rounds: int) -> dict:
        """The same ``n`` procs up on one agent, calls in turns (``rounds`` rounds of 3 of each), medians of wall
        and controller CPU µs and the chunks it received per call: ``all``, call() to every proc; ``fold``, the
        same replies folded in the agent (``Accumulator`` with ``max``: one run reaches the controller); ``slice``, call()
        to SLICE of them; ``bcast_slice``, broadcast() to the other n - SLICE, then call() to the SLICE (the same
        procs work as for ``all``; the controller gets SLICE replies), then, untimed, a call() to the others
        (their broadcast has run: one actor's messages run in order); ``bcast``, that broadcast alone (until
        ``broadcast()`` returned and the mailbox was flushed), then the untimed call; ``burner``, call() to the SLICE with one CPU-bound process
        of this machine running beside it (stopped between)."""
        part, rest = mesh.slice(gpus=slice(0, SLICE)), mesh.slice(gpus=slice(SLICE, n))
        acc = Accumulator(mesh.ping, 0, max)
        box = mailbox.current_mailbox()
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        kinds = ("all", "fold", "slice", "bcast_slice", "bcast", "burner")
        got: dict = {k: ([], [], []) for k in kinds}
        try:
            os.kill(burner.pid, signal.SIGSTOP)
            for _ in range(rounds):
                for kind in kinds:
                    for _ in range(3):
                        if kind == "burner":
                            os.kill(burner.pid, signal.SIGCONT)
                            time.sleep(0.002)
                        t, c, u = time.perf_counter(), time.process_time(), up_messages[0]
                        if kind == "all":
                            mesh.ping.call().get(timeout=120)
                        elif kind == "fold":
                            assert acc.accumulate().get(timeout=120) == 0
                        elif kind in ("slice", "burner"):
                            part.ping.call().get(timeout=120)
                        else:
                            rest.ping.broadcast()
                            if kind == "bcast":
                                box.flush()
                            else:
                                part.ping.call().get(timeout=120)
                        got[kind][0].append((time.perf_counter() - t) * 1e6)
                        got[kind][1].append((time.process_time() - c) * 1e6)
                        got[kind][2].append(up_messages[0] - u)
                        if kind == "burner":
                            os.kill(burner.pid, signal.SIGSTOP)
                        elif kind.startswith("bcast"):
                            rest.ping.call().get(timeout=120)
        finally:
            burner.kill()
            burner.wait()
        out: dict = {"procs": n, "slice_procs": SLICE}
        for kind, (w, c, u) in got.items():
            out[kind] = {"wall_us": statistics.median(w), "cpu_us": statistics.median(c), "chunks": statistics.fmean(u)}
        return out

    def spawn(hosts, per_host):
        t, c = time.perf_counter(), time.process_time()
        procs = hosts.spawn_procs(per_host={"gpus": per_host})
        mesh = procs.spawn("noop", Noop)
        mesh.ping.call().get(timeout=300)
        return procs, mesh, time.perf_counter() - t, (time.process_time() - c) * 1e3

    rows: list = []
    res: dict = {"tiny": args.tiny, "rows": rows, "loadavg_before": os.getloadavg()}
    job = LocalJob(meshes={"hosts": max(agents_sweep)}, ttl=300)
    try:
        all_hosts = job.state().hosts
        # Warm every agent's zygote (it imports torch once).
        p, _, _, _ = spawn(all_hosts, 1)
        p.stop().get(timeout=60)
        res["idle_cpu_rate"] = idle_cpu_rate()

        # hop_us: a proc behind an agent vs a proc of this host, same call.
        local = this_host().spawn_procs(per_host={"gpus": 1})
        lm = local.spawn("noop", Noop)
        lm.ping.call().get(timeout=120)
        p, m, _, _ = spawn(all_hosts.slice(hosts=0), 1)
        local_us, remote_us = timed_calls(lm, reps * 2)[0], timed_calls(m, reps * 2)[0]
        res["hop_us"] = max(0.0, remote_us - local_us)
        res["local_rtt_us"], res["agent_rtt_us"] = local_us, remote_us
        p.stop().get(timeout=60)
        local.stop().get(timeout=60)

        for n in procs_sweep:  # procs on one agent
            p, m, s, sc = spawn(all_hosts.slice(hosts=0), n)
            rows.append({"agents": 1, "procs": n, "fanout": FANOUT, "spawn_s": s, "spawn_cpu_ms": sc,
                         **both(m, reps), "idle_pct": 100 * idle_cpu_rate(0.5, 1)})
            _print(rows[-1])
            if n == max(procs_sweep) and n >= SLICE + 2:
                res["equal_load"] = equal_load(m, n, reps)
            p.stop().get(timeout=60)
        for fanout in (FANOUT, 1):
            _fanout.FANOUT = fanout
            for a in agents_sweep:
                if fanout == 1 and a != max(agents_sweep):
                    continue
                p, m, s, sc = spawn(all_hosts.slice(hosts=slice(0, a)), PER_AGENT)
                rows.append({"agents": a, "procs": a * PER_AGENT, "fanout": fanout, "spawn_s": s,
                             "spawn_cpu_ms": sc, **both(m, reps), "idle_pct": 100 * idle_cpu_rate(0.5, 1)})
                p.stop().get(timeout=60)
                _print(rows[-1])
        _fanout.FANOUT = FANOUT
    finally:
        job.kill()

    hosts, per = TARGET
    res["agent_level_us"] = agent_level_us(per, FANOUT, hosts * per // FANOUT)
    res["controller_entry"] = controller_entry(Noop)
    res["controller_entry_us"] = res["controller_entry"]["call_us"] + res["controller_entry"]["read_us"]
    res["agent_fold_level_us"] = agent_fold_level_us(per, FANOUT)
    res["controller_fold_us"] = controller_fold_us(hosts, per, FANOUT)
    res["send_ctl_us"] = {m: send_ctl_us(hosts, per, FANOUT, m == "fold") for m in ("gather", "fold")}
    res["spawn_plan"] = spawn_plan(hosts, per, FANOUT)
    res["loadavg_after"] = os.getloadavg()
    res["model"] = model(rows, res, agents_sweep)
    print(f"load average before {res['loadavg_before'][0]:.1f}, after {res['loadavg_after'][0]:.1f} "
          f"({os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


COLS = [("agents", 6, "d"), ("procs", 5, "d"), ("fanout", 6, "d"), ("spawn_s", 8, ".2f"), ("spawn_cpu_ms", 12, ".0f"),
        ("gather_us", 9, ".0f"), ("gather_cpu_us", 13, ".0f"), ("chunks", 6, ".1f"), ("direct_us", 9, ".0f"), ("direct_cpu_us", 13, ".0f"),
        ("fold_us", 7, ".0f"), ("fold_cpu_us", 11, ".0f"), ("idle_pct", 8, ".1f")]


def _print(r: dict) -> None:
    if not getattr(_print, "done", False):
        print("| " + " | ".join(f"{c:>{w}}" for c, w, _ in COLS) + " |")
        print("|" + "|".join("-" * (w + 1) + ":" for _, w, _ in COLS) + "|")
        _print.done = True
    print("| " + " | ".join(f"{r[c]:>{w}{f}}" for c, w, f in COLS) + " |", flush=True)


def agent_level_us(per: int = 8, fanout: int = FANOUT, subtree: int = 1024) -> float:
    """An agent's CPU for one call at one level of the tree (``_gather.Gathers`` in this process): its gather
    opened, ``per`` replies of its own procs taken one by one, ``fanout`` children's chunks of ``subtree``
    replies each taken, and its own chunk sent (packed); median of 5."""
    from monarch_tensor.hosts._gather import Gathers
    from monarch_tensor.transport import _fanout, _wire
    from monarch_tensor.transport.messages import SendToPort

    key = ["ipc:///c", 7]
    body = _wire.encode(SendToPort(7, 0, None, 3))
    head = _fanout.UP_MAGIC + b"g" + json.dumps({"k": key, "u": 0, "w": "gw"}).encode()
    sub: list = []  # a child's chunk of ``subtree`` replies, as its own gather sends it
    child = Gathers(lambda addr, frames: sub.append(frames), 60.0, 600.0)
    child.start({"g": key, "w": "gw", "u": "root", "t": [str(i) for i in range(subtree)], "c": []})
    for i in range(subtree):
        child.take(str(i), [head, *body])
    chunk = sub[-1]
    plan = {"g": key, "w": "gw", "t": [str(i) for i in range(per)],
            "c": [[f"c{k}", {"t": [str(i) for i in range(subtree)], "c": []}] for k in range(fanout)]}
    times = []
    for _ in range(5):
        g = Gathers(lambda addr, frames: None, 60.0, 600.0)
        t = time.process_time()
        g.start(plan)
        for i in range(per):
            g.take(str(i), [head, *body])
        for k in range(fanout):
            g.take(f"c{k}", chunk)
        times.append((time.process_time() - t) * 1e6)
        assert not g.open
    return statistics.median(times)


def controller_entry(cls, n: int = 4096, per: int = 8) -> dict:
    """The controller's CPU per rank of a gathered call(), in this process alone (µs, median of 5 after one):
    ``call_us``, ``mesh.ping.call()`` on an actor mesh of ``cls`` over ``n`` procs behind ``n / per`` host agents
    that do not exist (its checks, addresses, ``Collector`` and port; its sends left out: ``send_ctl_us`` times
    them); ``read_us``, a root agent's chunk of the ``n`` one-frame replies (its children's chunks nested in its
    own, made by ``_gather.Gathers``) read and handed to that call's port (``Mailbox._dispatch``, as the
    controller's receiving thread does), its ``ValueMesh`` made."""
    from monarch_tensor.actor import ActorMesh, Endpoint
    from monarch_tensor.hosts._gather import Gathers
    from monarch_tensor.hosts.local import ProcInfo
    from monarch_tensor.shape import Shape
    from monarch_tensor.transport import _fanout, _wire
    from monarch_tensor.transport.mailbox import current_mailbox
    from monarch_tensor.transport.messages import SendToPort

    mb = current_mailbox()
    procs = [ProcInfo(f"tcp://bench-e{i // per}:1|{i % per}", i) for i in range(n)]
    mesh = ActorMesh("noop", cls, procs, Shape(("hosts", "gpus"), (n // per, per)))
    calls, reads = [], []
    send, Endpoint._send = Endpoint._send, lambda *a, **k: None
    try:
        for _ in range(6):
            t = time.process_time()
            fut = mesh.ping.call()
            calls.append((time.process_time() - t) * 1e6 / n)
            port = fut._interrupt[1]
            key = [port.addr, port.port_id]
            sent: list = []
            root = Gathers(lambda addr, frames, sent=sent: sent.append(frames), 60.0, 600.0)
            kids = n // per - 1  # the root's own procs, and its children's subtrees of ``per`` procs each
            root.start({"g": key, "w": "gw", "t": [str(i) for i in range(per)],
                        "c": [[f"c{k}", {"t": [str(i) for i in range(per)], "c": []}] for k in range(kids)]})
            for k in range(kids + 1):
                g = root if k == kids else Gathers(lambda addr, frames, k=k, root=root: root.take(f"c{k}", frames),
                                                   60.0, 600.0)
                if k < kids:
                    g.start({"g": key, "w": "gw", "u": "root", "t": [str(i) for i in range(per)], "c": []})
                base = k * per if k < kids else kids * per
                for i in range(per):
                    head = _fanout.UP_MAGIC + b"g" + json.dumps({"k": key, "u": 0, "w": "gw"}).encode()
                    g.take(str(i), [head, *_wire.encode(SendToPort(port.port_id, 0, None, base + i))])
            frames = [bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[-1]]
            t = time.process_time()
            mb._dispatch(frames)
            reads.append((time.process_time() - t) * 1e6 / n)
            assert fut.done() and len(fut.get(timeout=1)) == n
    finally:
        Endpoint._send = send
    return {"call_us": statistics.median(calls[1:]), "read_us": statistics.median(reads[1:])}


def _fold_spec() -> dict:
    import base64
    import pickle

    return {"f": base64.b64encode(pickle.dumps(max)).decode(), "e": ["int", "bool", "str"]}


def _runs_chunk(key: list, runs: list, accounted: int) -> list:
    """A chunk as a folding agent sends it: its runs (``FoldedReplies``) as the first entry, nothing else."""
    from monarch_tensor.transport import _fanout, _wire
    from monarch_tensor.transport.messages import FoldedReplies

    folded = _wire.encode(FoldedReplies(key[1], tuple(runs)))
    head = {"k": key, "a": accounted, "n": [len(folded)], "u": 0, "w": "gw", "f": 1}
    return [_fanout.up_header(b"g", head), *folded]


def agent_fold_level_us(per: int = 8, fanout: int = FANOUT, runs: int = 3) -> float:
    """An agent's CPU for one folded call (``Accumulator`` with ``max``) at one level: its gather opened, ``per``
    plain replies of its own procs folded, ``fanout`` children's chunks of ``runs`` runs each merged (each
    child's runs adjacent, as siblings' are at each level of the tree), its own chunk sent; median of 5."""
    from monarch_tensor.hosts._gather import Gathers
    from monarch_tensor.transport import _fanout, _wire
    from monarch_tensor.transport.messages import SendToPort

    key = ["ipc:///c", 7]
    head = _fanout.UP_MAGIC + b"g" + json.dumps({"k": key, "u": 0, "w": "gw"}).encode()
    bodies = [_wire.encode(SendToPort(7, 0, None, i)) for i in range(per)]
    width = 64  # places per run
    chunks = [_runs_chunk(key, [(per + (k * runs + j) * width, per + (k * runs + j + 1) * width - 1, 0)
                                for j in range(runs)], runs * width) for k in range(fanout)]
    plan = {"g": key, "w": "gw", "r": _fold_spec(), "t": [str(i) for i in range(per)], "p": list(range(per)),
            "c": [[f"c{k}", {"t": [], "c": []}] for k in range(fanout)]}
    times = []
    for _ in range(5):
        g = Gathers(lambda addr, frames: None, 60.0, 600.0)
        plan["c"] = [[f"c{k}", {"t": [str(i) for i in range(runs * width)], "c": []}] for k in range(fanout)]
        t = time.process_time()
        g.start(plan)
        for i in range(per):
            g.take(str(i), [head, *bodies[i]])
        for k in range(fanout):
            g.take(f"c{k}", chunks[k])
        times.append((time.process_time() - t) * 1e6)
        assert not g.open
    return statistics.median(times)


def controller_fold_us(hosts: int = 1024, per: int = 8, fanout: int = FANOUT) -> float:
    """The controller's CPU for the replies of one folded call to ``hosts`` x ``per`` procs, in this process: what
    ``Endpoint._collect`` does per rank (the call's addresses listed and checked, its ``FoldCollector`` made), and
    one chunk per root agent read, each with one run per level of the tree (``depth`` runs), the fold finished;
    median of 5."""
    from monarch_tensor.transport._ports import FoldCollector
    from monarch_tensor.transport.mailbox import Mailbox

    n, d = hosts * per, depth(hosts, fanout)
    roots = min(hosts, fanout)
    bounds = [round(i * n / (roots * d)) for i in range(roots * d + 1)]
    mb = Mailbox(io_thread=False)
    procs = [f"tcp://h{i // per}:1|{i % per}" for i in range(n)]
    ranks = list(range(n))
    times = []
    try:
        for _ in range(5):
            t = time.process_time()
            addrs = [procs[r] for r in ranks]
            assert all("|" in a for a in addrs)
            col = FoldCollector(addrs, ranks, 0, max)
            port = mb.open_port(col)
            made = time.process_time() - t
            key = [port.addr, port.port_id]
            chunks = []
            for r in range(roots):
                runs = [(bounds[i], bounds[i + 1] - 1, 0) for i in range(r * d, (r + 1) * d)]
                chunks.append([bytes(f) for f in _runs_chunk(key, runs, sum(b - a + 1 for a, b, _ in runs))])
            t = time.process_time()
            for frames in chunks:
                mb._dispatch(frames)
            times.append((made + time.process_time() - t) * 1e6)
            assert col.future.get(timeout=1) == 0 and col.folded == n
    finally:
        mb.close()
    return statistics.median(times)


def send_ctl_us(hosts: int = 1024, per: int = 8, fanout: int = FANOUT, fold: bool = False) -> dict:
    """The controller's CPU to send one call to ``hosts`` x ``per`` procs down the tree (``_fanout.send_many``,
    its sockets' sends left out), gathered or folded: the first call to these procs ("first": every agent's plan
    built and encoded) and the median of the next 5 ("next": the plans made for the first, reused)."""
    from monarch_tensor.transport import _fanout

    class Sink:
        def send_frames(self, addr, frames):
            pass

    agents = [f"tcp://bench-h{i}:1" for i in range(hosts)]
    for a in agents:
        _fanout.register(a, "scale-bench")
    _fanout.set_gateway(agents[0], "tcp://gw:1")
    addrs = [f"{agents[i // per]}|{i % per}" for i in range(hosts * per)]
    old, _fanout.FANOUT = _fanout.FANOUT, fanout
    times = []
    try:
        for i in range(6):
            t = time.process_time()
            _fanout.send_many(Sink(), addrs, [b"x" * 200], ("ipc:///c", i), _fold_spec() if fold else None)
            times.append((time.process_time() - t) * 1e6)
    finally:
        _fanout.FANOUT = old
        for a in agents:
            _fanout.forget(a)
    return {"first": times[0], "next": statistics.median(times[1:])}


def spawn_plan(hosts: int = 1024, per: int = 8, fanout: int = FANOUT) -> dict:
    """The CPU of a spawn on ``hosts`` x ``per`` procs down the tree, in this process (median of 3): the controller's
    (``ctl_ms``: each agent's ``SpawnProcs`` made with its procs' environments, as ``spawn_procs`` makes them,
    ``_spawn_tree.plan``, and each root's request encoded) and a root agent's (``agent_ms``: its request decoded, each
    child's part encoded with its ``reply_to``)."""
    import dataclasses

    from monarch_tensor import config
    from monarch_tensor.hosts import _spawn_tree
    from monarch_tensor.hosts.agent_messages import SpawnProcs
    from monarch_tensor.transport import _fanout, _wire
    from monarch_tensor.transport.messages import PortRef

    agents = [f"tcp://bench-s{i}:1" for i in range(hosts)]
    for a in agents:
        _fanout.register(a, "scale-bench-spawn")
    settings = config.proc_env()
    ctl, agent = [], []
    try:
        for _ in range(3):
            t = time.process_time()
            parts = {}
            for h, a in enumerate(agents):
                ranks = range(h * per, (h + 1) * per)
                envs = tuple({"MONARCH_TENSOR_RANK": str(r), **settings, "MONARCH_TENSOR_THREADS": f"share:{per}",
                              "MONARCH_TENSOR_LOCAL_GPU": str(r % per)} for r in ranks)
                parts[a] = SpawnProcs("bench", tuple(ranks), envs, "ipc:///c", "tcp://gw:1", PortRef("ipc:///c", h),
                                      None, "id")
            roots = _spawn_tree.plan("bench", parts, 60.0, fanout=fanout)
            frames = [_wire.encode((1, tree)) for _, tree, _ in roots]
            ctl.append((time.process_time() - t) * 1e3)
            body = [bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames[0]]
            t = time.process_time()
            _, tree = _wire.decode(body)
            for _child, sub in tree.below:
                _wire.encode((None, dataclasses.replace(sub, reply_to=("tcp://bench-s0:1", 1))))
            agent.append((time.process_time() - t) * 1e3)
    finally:
        for a in agents:
            _fanout.forget(a)
    return {"ctl_ms": statistics.median(ctl), "agent_ms": statistics.median(agent)}


def idle_cpu_rate(seconds: float = 1.0, n: int = 3) -> float:
    """The controller's CPU per second of wall clock while it waits for nothing (its watcher, keep-alives, the
    gateway's and mailbox's threads), the job's agents up: what every figure of this process also counts for
    the time it lasted; median of ``n``."""
    rates = []
    for _ in range(n):
        c = time.process_time()
        time.sleep(seconds)
        rates.append((time.process_time() - c) / seconds)
    return statistics.median(rates)


def _slope(xs, ys) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den) if den else 0.0


def depth(hosts: int, fanout: int) -> int:
    """Agent hops from the controller to the farthest host of the tree in ``_fanout``."""
    from monarch_tensor.transport._fanout import depth as tree_depth

    return tree_depth(hosts, fanout)


def model(rows, res, agents_sweep) -> dict:
    # (a call() to one proc is never gathered: the slopes start at 2 procs)
    one = [r for r in rows if r["agents"] == 1 and r["fanout"] == FANOUT and r["procs"] > 1]
    procs1 = [r["procs"] for r in one]
    entry_us = _slope(procs1, [r["gather_cpu_us"] for r in one])
    reply_us = _slope(procs1, [r["direct_cpu_us"] for r in one])
    flat = [r for r in rows if r["fanout"] == FANOUT and r["procs"] == r["agents"] * PER_AGENT]
    per_agent = _slope([r["agents"] for r in flat], [r["gather_cpu_us"] for r in flat])
    chunk_us = max(0.0, per_agent - PER_AGENT * entry_us)
    spawn_agent_ms = _slope([r["agents"] for r in flat], [r["spawn_cpu_ms"] for r in flat])
    spawn_agent_wall_s = _slope([r["agents"] for r in flat], [r["spawn_s"] for r in flat])
    amax = max(agents_sweep)
    chain = next((r for r in rows if r["fanout"] == 1), None)
    wide = next((r for r in flat if r["agents"] == amax), None)
    level = {}
    for mode in MODES:
        k = f"{mode}_us"
        level[mode] = max(0.0, (chain[k] - wide[k]) / (amax - 1)) if chain and wide and amax > 1 else 0.0
    hosts, per = TARGET
    d = depth(hosts, FANOUT)
    base = min(one, key=lambda r: abs(r["procs"] - per))
    agent_us = res["agent_level_us"]
    roots = min(hosts, FANOUT)
    send = {m: res["hop_us"] + (d - 1) * level[m] for m in MODES}
    alone_us = res["controller_entry_us"]
    # The controller's CPU per entry with the machine's load held equal (``equal_load``): the same procs up, calls
    # to SLICE or all of them (``slice_entry_us``); the same procs up and working: a broadcast to the rest with a
    # call to SLICE (``work_entry_us``, which counts the broadcast's own CPU as timed alone), or the same call folded
    # in the agent (``fold_entry_us``: only what the controller reads differs, N values or one run). The model takes
    # the last for reading a reply, never less than that timed alone, plus the call's own CPU per rank timed alone
    # (folded or not, a call pays it): what the raw slope adds follows the load on this machine's cores.
    eq, ce = res.get("equal_load"), res["controller_entry"]
    if eq:
        k = eq["procs"] - eq["slice_procs"]
        cpu = {kind: eq[kind]["cpu_us"] for kind in ("all", "fold", "slice", "bcast_slice", "bcast", "burner")}
        slice_entry_us = max(0.0, (cpu["all"] - cpu["slice"]) / k)
        work_entry_us = max(0.0, (cpu["all"] - cpu["bcast_slice"] + cpu["bcast"]) / k)
        fold_entry_us = max(0.0, (cpu["all"] - cpu["fold"]) / eq["procs"])
        burner_us = cpu["burner"] - cpu["slice"]
    else:  # (too few procs up for the comparison: the raw slope)
        slice_entry_us = work_entry_us = fold_entry_us = entry_us
        burner_us = 0.0
    model_entry_us = max(fold_entry_us, ce["read_us"]) + ce["call_us"]
    send_ctl = res["send_ctl_us"]
    gather_ctl = roots * chunk_us + hosts * per * model_entry_us + send_ctl["gather"]["next"]
    gather_us = res["local_rtt_us"] + send["gather"] + d * agent_us + gather_ctl
    raw_gather_ctl = roots * chunk_us + hosts * per * entry_us + send_ctl["gather"]["next"]
    raw_gather_us = gather_us - gather_ctl + raw_gather_ctl
    direct_ctl = hosts * per * reply_us
    direct_us = res["local_rtt_us"] + send["direct"] + direct_ctl
    # The same slopes net of the controller's idle CPU over each figure's wall time (a call to more procs lasts
    # longer on this machine's 2 cores, and the controller's background threads run meanwhile).
    rate = res.get("idle_cpu_rate", 0.0)

    def net(r: dict) -> float:  # the row's gathered call's CPU less its mesh's idle CPU over that call's wall time
        return r["gather_cpu_us"] - r["idle_pct"] / 100 * r["gather_us"]

    net_entry_us = _slope(procs1, [net(r) for r in one])
    net_per_agent = _slope([r["agents"] for r in flat], [net(r) for r in flat])
    net_chunk_us = max(0.0, net_per_agent - PER_AGENT * net_entry_us)
    net_spawn_agent_ms = _slope([r["agents"] for r in flat], [r["spawn_cpu_ms"] - rate * r["spawn_s"] * 1e3 for r in flat])
    spawn_level_s = max(0.0, (chain["spawn_s"] - wide["spawn_s"]) / (amax - 1)) if chain and wide and amax > 1 else 0.0
    plan = res["spawn_plan"]
    spawn_s = base["spawn_s"] + (d - 1) * spawn_level_s + d * plan["agent_ms"] / 1e3 + hosts * spawn_agent_ms / 1e3
    net_spawn_s = spawn_s - hosts * (spawn_agent_ms - net_spawn_agent_ms) / 1e3
    net_gather_ctl = roots * net_chunk_us + hosts * per * net_entry_us + send_ctl["gather"]["next"]
    net_gather_us = raw_gather_us - raw_gather_ctl + net_gather_ctl
    fold_agent_us, fold_read_us = res["agent_fold_level_us"], res["controller_fold_us"]
    fold_ctl = roots * chunk_us + fold_read_us + send_ctl["fold"]["next"]
    fold_us = res["local_rtt_us"] + res["hop_us"] + (d - 1) * level["fold"] + d * fold_agent_us + fold_ctl
    m = {"hop_us": res["hop_us"], "level_us": level, "entry_us": entry_us, "entry_alone_us": alone_us,
         "chunk_us": chunk_us, "gather_alone_us": gather_us - hosts * per * (model_entry_us - alone_us),
         "entry_slice_us": slice_entry_us, "entry_work_us": work_entry_us, "entry_model_us": model_entry_us,
         "entry_fold_us": fold_entry_us,
         "burner_us": burner_us, "gather_raw_us": raw_gather_us, "gather_raw_ctl_us": raw_gather_ctl,
         "agent_level_us": agent_us, "reply_us": reply_us, "spawn_agent_ms": spawn_agent_ms,
         "idle_cpu_rate": rate, "net_entry_us": net_entry_us, "net_chunk_us": net_chunk_us,
         "net_spawn_agent_ms": net_spawn_agent_ms, "gather_net_us": net_gather_us, "spawn_net_s": net_spawn_s,
         "spawn_agent_wall_s": spawn_agent_wall_s, "spawn_level_s": spawn_level_s, "spawn_plan": plan, "target": f"{hosts} hosts x {per} procs", "fanout": FANOUT,
         "depth": d, "gather_us": gather_us, "gather_ctl_us": gather_ctl, "direct_us": direct_us,
         "direct_ctl_us": direct_ctl, "bcast_us": gather_us, "spawn_s": spawn_s, "fold_us": fold_us,
         "fold_ctl_us": fold_ctl, "agent_fold_level_us": fold_agent_us, "controller_fold_us": fold_read_us,
         "send_ctl_us": send_ctl}
    print(f"\nmeasured: local rtt {res['local_rtt_us']:.0f} us, via an agent {res['agent_rtt_us']:.0f} us "
          f"(hop {res['hop_us']:.0f} us); tree level {level['gather']:.0f} us gathered, {level['direct']:.0f} us "
          f"direct; controller CPU per gathered entry {entry_us:.1f} us, per agent's chunk {chunk_us:.0f} us, "
          f"per direct reply {reply_us:.1f} us; an agent's CPU per call at one level {agent_us:.0f} us; controller "
          f"CPU per agent "
          f"in a spawn {spawn_agent_ms:.1f} ms ({spawn_agent_wall_s * 1e3:.0f} ms wall), a spawn's tree level "
          f"{spawn_level_s * 1e3:.0f} ms wall")
    if eq:
        def row(kind: str) -> str:
            return (f"{eq[kind]['cpu_us']:.0f} us CPU ({eq[kind]['wall_us']:.0f} us wall, "
                    f"{eq[kind]['chunks']:.1f} chunks)")

        print(f"the same {eq['procs']} procs up on one agent, calls in turns: call() to all {row('all')}; the same "
              f"folded in the agent {row('fold')}; to "
              f"{eq['slice_procs']} of them {row('slice')}; broadcast() to the other {k}, then call() to the "
              f"{eq['slice_procs']} {row('bcast_slice')}, that broadcast alone {eq['bcast']['cpu_us']:.0f} us CPU; "
              f"call() to the {eq['slice_procs']} with one CPU-bound process beside {row('burner')}, {burner_us:+.0f} us")
    print(f"controller CPU per gathered entry: {entry_us:.1f} us raw slope (1 agent, 2-{max(procs1, default=0)} "
          f"procs, each count up alone), {slice_entry_us:.1f} us with the same procs up (calls to {SLICE} and to all "
          f"of them), with the same procs up and working {work_entry_us:.1f} us (a broadcast to the rest with the "
          f"call to {SLICE}, less the broadcast's CPU timed alone) or {fold_entry_us:.1f} us (the same call folded in "
          f"the agent: only what the controller reads differs), {alone_us:.2f} us alone in this process (the call "
          f"{ce['call_us']:.2f}, its replies read {ce['read_us']:.2f}). The model takes {model_entry_us:.2f} us: "
          f"the folded comparison's (at least the read alone) plus the call alone; the rest of the raw slope is "
          f"this machine's {os.cpu_count()} cores shared with the procs, not work per reply")
    print(f"projected, {hosts} hosts x {per} procs, fan-out {FANOUT} (depth {d}):")
    print(f"  call() gathered {gather_us / 1e3:.1f} ms = rtt {res['local_rtt_us'] / 1e3:.2f} + send side "
          f"{send['gather'] / 1e3:.2f} + {d} agent levels {d * agent_us / 1e3:.2f} + "
          f"controller {gather_ctl / 1e3:.2f} ({roots} chunks {roots * chunk_us / 1e3:.2f}, {hosts * per} entries "
          f"x {model_entry_us:.2f} us {hosts * per * model_entry_us / 1e3:.2f}, the tree's plans sent "
          f"{send_ctl['gather']['next'] / 1e3:.2f})")
    print(f"  (with the raw slope, {entry_us:.1f} us per entry: call() gathered {raw_gather_us / 1e3:.1f} ms; with "
          f"the in-process figure, {alone_us:.2f} us: {m['gather_alone_us'] / 1e3:.1f} ms)")
    print(f"  (the raw slope net of the controller's idle CPU with each row's mesh up, idle_pct of that call's wall "
          f"time: per entry {net_entry_us:.1f} us, per chunk {net_chunk_us:.0f} us: call() gathered "
          f"{net_gather_us / 1e3:.1f} ms, of which controller {net_gather_ctl / 1e3:.2f})")
    print(f"  Accumulator (max, folded in the agents) {fold_us / 1e3:.1f} ms = rtt {res['local_rtt_us'] / 1e3:.2f} + "
          f"send side {(res['hop_us'] + (d - 1) * level['fold']) / 1e3:.2f} + {d} agent levels "
          f"{d * fold_agent_us / 1e3:.2f} + controller {fold_ctl / 1e3:.2f} ({roots} chunks {roots * chunk_us / 1e3:.2f}, "
          f"the call's {hosts * per} ranks listed and their runs read and folded {fold_read_us / 1e3:.2f}, the "
          f"tree's plans sent {send_ctl['fold']['next'] / 1e3:.2f})")
    print(f"  (the first call to a mesh builds the tree's plans: {send_ctl['fold']['first'] / 1e3:.1f} ms folded, "
          f"{send_ctl['gather']['first'] / 1e3:.1f} ms gathered; later calls reuse them: "
          f"{send_ctl['gather']['next'] / 1e3:.2f} ms gathered)")
    print(f"  call() direct   {direct_us / 1e3:.1f} ms = rtt {res['local_rtt_us'] / 1e3:.2f} + send side "
          f"{send['direct'] / 1e3:.2f} + controller {hosts * per} replies {direct_ctl / 1e3:.1f}")
    print(f"  spawn {spawn_s:.1f} s = {base['procs']} procs on one agent {base['spawn_s']:.2f} s + {d - 1} more levels "
          f"x {spawn_level_s * 1e3:.0f} ms + {d} root agents' passes x {plan['agent_ms']:.1f} ms + {hosts} agents x "
          f"{spawn_agent_ms:.2f} ms controller CPU")
    print(f"  (the controller's planning and encoding of that spawn alone, in this process: {plan['ctl_ms']:.0f} ms, "
          f"beside {hosts} x {spawn_agent_ms:.2f} = {hosts * spawn_agent_ms:.0f} ms from the live slope; it sends "
          f"{min(hosts, FANOUT)} requests; net of the idle CPU, {net_spawn_agent_ms:.2f} ms per agent: spawn "
          f"{net_spawn_s:.1f} s)")
    return m


if __name__ == "__main__":
    main()
