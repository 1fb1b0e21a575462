"""Replies up the agent tree (``_fanout.GATHER``, ``_gather.py``) on real agents: chunks, per-rank errors and
deaths, a dead subtree, one sender's order; reductions folded in the agents (``Accumulator``), pure and live.

Spawns down the agent tree (``_spawn_tree``): ranks and places, a failed spawn on one agent, a dead agent.

One LocalJob (module fixture): two hosts of two procs each, a spare host that a test kills, and a doomed host
whose template process, then agent, the spawn tests kill. The
agents' gather window is long (``MONARCH_TENSOR_GATHER_WINDOW_MS``), so what the tests see is what the rules
send at once (a whole subtree answered, an error, a death, a message passed up), never a window's flush.
"""

import os
import signal
import time

import numpy as np
import pytest

from monarch_tensor.actor import Accumulator, Actor, ActorError, Channel, SupervisionError, current_rank, endpoint
from monarch_tensor.job import LocalJob
from monarch_tensor.transport import _fanout, mailbox
from monarch_tensor.transport._ports import Collector, FoldCollector, Receiver


class Echo(Actor):
    @endpoint
    def value(self, big: bool = False):
        r = current_rank().rank
        return (r, np.full(1 << 18, r, dtype=np.float32)) if big and r == 1 else (r, r * 10)

    @endpoint
    def fail_on(self, ranks: list, gate: str = ""):
        r = current_rank().rank
        if r in ranks:
            raise ValueError(f"rank {r} fails")
        if gate:
            _wait_for(gate)
        return r

    @endpoint
    def exit_on(self, rank: int):
        if current_rank().rank == rank:
            os._exit(3)
        return current_rank().rank

    @endpoint
    def emit(self, port, i: int, slow_rank: int):
        r = current_rank().rank
        if r == slow_rank:
            import time

            time.sleep(0.02)  # (its peer's reply to this call waits at the agent meanwhile)
        port.send((r, i))
        return i

    @endpoint
    def label(self):
        return f"<{current_rank().rank}>"

    @endpoint
    def where(self):
        p = current_rank()
        return p.rank, dict(p), os.environ["MONARCH_TENSOR_PUBLIC_ADDR"].partition("=")[2].partition("|")[0]

    @endpoint
    def wait_gate(self, gate: str):
        _wait_for(gate)
        return current_rank().rank


def _wait_for(path: str, limit: float = 60) -> None:
    import time

    t0 = time.monotonic()
    while not os.path.exists(path) and time.monotonic() - t0 < limit:
        time.sleep(0.01)


def _wait_for_value(ok, limit: float = 30) -> None:
    import time

    t0 = time.monotonic()
    while not ok() and time.monotonic() - t0 < limit:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    old = os.environ.get("MONARCH_TENSOR_GATHER_WINDOW_MS")
    os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"] = "60000"
    try:
        j = LocalJob(meshes={"hosts": 2, "spare": 1, "doomed": 1}, root_dir=str(tmp_path_factory.mktemp("job")), ttl=120)
        j.state()
    finally:
        if old is None:
            del os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"]
        else:
            os.environ["MONARCH_TENSOR_GATHER_WINDOW_MS"] = old
    yield j
    j.kill()


@pytest.fixture(scope="module")
def echo(job):
    procs = job.state().hosts.spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("echo", Echo)
    mesh.initialized.get(timeout=60)
    yield mesh
    procs.stop().get(timeout=30)


@pytest.fixture
def chunks(monkeypatch):
    """The chunks of gathered replies this process receives: (port id, ranks of their replies, errors)."""
    seen = []
    orig = mailbox.Mailbox._up_entries

    def spy(self, frames):
        msgs = list(orig(self, frames))
        ranks, errors = [], []
        for m, _ in msgs:
            if isinstance(m, mailbox._Replies):  # plain values, delivered in one go
                ranks += m.ranks
            elif getattr(m, "port_id", 0) > 0:
                ranks.append(m.rank)
                if m.error is not None:
                    errors.append(m.rank)
        seen.append((ranks, errors))
        yield from msgs

    monkeypatch.setattr(mailbox.Mailbox, "_up_entries", spy)
    return seen


@pytest.mark.timeout(120)
def test_each_agent_sends_one_chunk_per_call_and_results_equal_the_direct_path(echo, chunks, monkeypatch):
    gathered = [echo.value.call(big).get(timeout=30) for big in (False, True, False)]
    assert len(chunks) == 6  # one per agent per call: each holds its two procs' replies
    assert sorted(sorted(ranks) for ranks, _ in chunks) == [[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [2, 3]]
    monkeypatch.setattr(_fanout, "GATHER", False)
    chunks.clear()
    direct = [echo.value.call(big).get(timeout=30) for big in (False, True, False)]
    assert chunks == []  # (each reply came on its own)
    for a, b in zip(gathered, direct):
        assert [v[0] for v in a.values()] == [v[0] for v in b.values()] == [0, 1, 2, 3]
        for (_, x), (_, y) in zip(a.values(), b.values()):
            np.testing.assert_array_equal(x, y)
    assert gathered[1].item(hosts=0, gpus=1)[1].shape == (1 << 18,)


@pytest.mark.timeout(120)
def test_a_failed_rank_fails_the_call_at_once_and_hides_no_other_value(echo, chunks, tmp_path):
    gate = str(tmp_path / "gate")
    with pytest.raises(ActorError, match="rank 2 fails"):  # rank 3, its agent's other proc, waits meanwhile
        echo.fail_on.call([2], gate).get(timeout=30)
    assert ([2], [2]) in chunks  # the error went up at once, alone
    open(gate, "w").close()
    # The others' values came all the same (rank 3's once it answered).
    _wait_for_value(lambda: sorted(r for ranks, _ in chunks for r in ranks) == [0, 1, 2, 3])
    assert sorted(r for ranks, _ in chunks for r in ranks) == [0, 1, 2, 3]
    with pytest.raises(ActorError, match="rank [03] fails"):
        echo.fail_on.call([0, 3]).get(timeout=30)
    assert echo.value.call().get(timeout=30).values() == [(r, r * 10) for r in range(4)]


@pytest.mark.timeout(120)
def test_messages_from_one_proc_reach_the_caller_in_the_order_sent(echo, chunks, monkeypatch):
    """A proc's channel value for call i+1 never overtakes its reply to call i, which its agent may hold
    waiting for a slower peer (the value goes up behind it)."""
    order = []
    deliver, deliver_values, receive = Collector.deliver, Collector.deliver_values, Receiver.deliver

    def on_reply(self, msg):
        order.append(("reply", msg.rank, msg.value))
        return deliver(self, msg)

    def on_replies(self, ranks, values):
        order.extend(("reply", r, v) for r, v in zip(ranks, values))
        return deliver_values(self, ranks, values)

    def on_value(self, msg):
        order.append(("value", *msg.value))
        return receive(self, msg)

    monkeypatch.setattr(Collector, "deliver", on_reply)
    monkeypatch.setattr(Collector, "deliver_values", on_replies)
    monkeypatch.setattr(Receiver, "deliver", on_value)
    port, recv = Channel.open()
    two = echo.slice(hosts=0)
    futures = [two.emit.call(port, i, 1) for i in range(10)]
    assert [f.get(timeout=30).values() for f in futures] == [[i, i] for i in range(10)]
    for _ in range(20):
        recv.recv().get(timeout=30)
    for rank in (0, 1):
        mine = [e for e in order if e[1] == rank]
        assert mine == [e for i in range(10) for e in (("value", rank, i), ("reply", rank, i))]


@pytest.mark.timeout(180)
def test_a_dead_proc_or_subtree_fails_its_own_ranks_and_holds_nothing_else(job, monkeypatch, tmp_path):
    """A chain (fan-out 1): controller -> host 0 -> host 1 -> spare, procs on host 0 and the spare. A proc
    that dies, then the spare's agent dying while a call waits on it: their ranks fail by supervision, the
    call does not hang, and the host before them still answers; then a proc dying in a folded call."""
    from monarch_tensor import actor as actor_mod
    from monarch_tensor.hosts.remote_hosts import RemoteHostMesh

    monkeypatch.setattr(actor_mod, "unhandled_fault_hook", lambda f: None)
    monkeypatch.setattr(_fanout, "FANOUT", 1)
    st = job.state()
    procs = RemoteHostMesh([st.hosts._agents[0], st.spare._agents[0]]).spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("echo", Echo)
    assert m.value.call().get(timeout=60).values() == [(r, r * 10) for r in range(4)]
    with pytest.raises(SupervisionError):
        m.exit_on.call(3).get(timeout=30)
    assert m.slice(hosts=0).value.call().get(timeout=30).values() == [(0, 0), (1, 10)]
    gate = str(tmp_path / "gate")
    pending = m.slice(gpus=0).wait_gate.call(gate)
    os.kill(job.pids[2], signal.SIGKILL)  # the spare's agent, and with it its procs
    with pytest.raises(SupervisionError):
        pending.get(timeout=30)
    open(gate, "w").close()
    assert m.slice(hosts=0).value.call().get(timeout=30).values() == [(0, 0), (1, 10)]
    # a folded call: the rank that dies fails it by supervision, its peer's value (held folded) holds nothing up
    with pytest.raises(SupervisionError):
        Accumulator(m.slice(hosts=0).exit_on, 0, lambda a, b: a + b, associative=True).accumulate(1).get(timeout=30)
    procs.stop().get(timeout=30)


# ---- pure: the agent's gathers and the caller's reading of chunks, no processes ---------------------------
def _agent_tree(sent: list):
    """A two-level tree in one process: a root agent's and a child agent's ``Gathers``; what the root sends
    up lands in ``sent``, what the child sends goes to the root."""
    from monarch_tensor.hosts._gather import Gathers

    root = Gathers(lambda addr, frames: sent.append((addr, frames)), 60.0, 600.0)
    child = Gathers(lambda addr, frames: root.take(b"child", frames), 60.0, 600.0)
    return root, child


def _reply(key, rank, value=None, error=None):
    import json

    from monarch_tensor.transport import _wire
    from monarch_tensor.transport.messages import SendToPort

    head = _fanout.UP_MAGIC + b"g" + json.dumps({"k": key, "u": int(error is not None), "w": "gw"}).encode()
    return [head, *_wire.encode(SendToPort(key[1], value, error, rank))]


def test_chunks_up_two_levels_read_as_the_replies_one_by_one_would_be():
    """Entries of a child's chunk and the root's own, errors among them, reach the caller's port in full and in
    order, as the same replies sent one by one would."""
    from monarch_tensor.transport import _wire
    from monarch_tensor.transport.messages import SendToPort

    mb = mailbox.Mailbox(io_thread=False)
    try:
        col = Collector([f"a|{i}" for i in range(6)], list(range(6)), list)
        port = mb.open_port(col)
        key = [port.addr, port.port_id]
        sent: list = []
        root, child = _agent_tree(sent)
        root.start({"g": key, "w": "gw", "t": ["0", "1", "2"], "c": [["child", {"t": ["3", "4", "5"], "c": []}]]})
        child.start({"g": key, "w": "gw", "u": "root", "t": ["3", "4", "5"], "c": []})
        for r in (3, 5):
            child.take(str(r), _reply(key, r, value=r * 10))
        for r in (0, 1):
            root.take(str(r), _reply(key, r, value=np.arange(r + 3)))
        assert sent == []  # nobody answered in full yet
        child.take("4", _reply(key, 4, value=40))  # the child's subtree is done: its chunk goes to the root
        root.take("2", _reply(key, 2, value="two"))
        assert len(sent) == 1 and sent[0][0] == "gw"
        mb._dispatch([bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[0][1]])
        got = col.future.get(timeout=1)
        assert got[2:] == ["two", 30, 40, 50] and [list(a) for a in got[:2]] == [[0, 1, 2], [0, 1, 2, 3]]

        # An error goes up at once, alone, and fails the call as a reply of its own would.
        col2 = Collector([f"a|{i}" for i in range(6)], list(range(6)), list)
        port2 = mb.open_port(col2)
        key2 = [port2.addr, port2.port_id]
        root.start({"g": key2, "w": "gw", "t": ["0", "1", "2"], "c": [["child", {"t": ["3", "4", "5"], "c": []}]]})
        child.start({"g": key2, "w": "gw", "u": "root", "t": ["3", "4", "5"], "c": []})
        root.take("0", _reply(key2, 0, value=0))
        child.take("4", _reply(key2, 4, error=ValueError("rank 4")))
        assert len(sent) == 2
        mb._dispatch([bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[1][1]])
        with pytest.raises(ValueError, match="rank 4"):
            col2.future.get(timeout=1)
        # (The error took the root's held entries up with it.) A message a proc passes up goes behind its held
        # reply, at once.
        root.take("1", _reply(key2, 1, value=1))
        assert len(sent) == 2
        root.pass_up("1", "gw", _wire.encode(SendToPort(99, "after", None, 0)))
        assert len(sent) == 3
        frames = [bytes(f.buffer if hasattr(f, "buffer") else f) for f in sent[2][1]]
        msgs = [m for m, _ in mb._decoded(frames)]
        assert [(m.port_id, m.values) for m in msgs] == [(port2.port_id, [1]), (99, ["after"])]
        # A proc that exits accounts for its rank: the gathers waiting on it may finish.
        root.proc_exited("2")
        assert list(root.open) == [tuple(key2)]  # the child's ranks 3 and 5 are still out
    finally:
        mb.close()


def test_an_agent_sends_its_procs_builtin_replies_as_one_entry_and_the_rest_as_they_came():
    """Property: replies of any mix of builtin values, values of other types (a Fraction, whose class the agent
    must not look up) and errors, taken in any order by a root agent and a child: the caller gets every value at
    its rank, exactly as sent (types too), the first error fails the call, and each agent's builtin replies came
    as one ``GatheredReplies`` entry."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from monarch_tensor.transport import _wire

    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                     st.binary(max_size=5))
    builtin = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.tuples(c, c),
                                                     st.dictionaries(st.text(max_size=3), c, max_size=3)),
                           max_leaves=6)
    value = st.one_of(builtin, st.fractions().map(lambda f: ("frac", f)), st.just(("error", None)))

    @settings(max_examples=25, deadline=None)
    @given(st.lists(value, min_size=2, max_size=8), st.integers(0, 2**32 - 1))
    def check(values, seed):
        import random

        rng = random.Random(seed)
        n = len(values)
        cut = rng.randint(1, n)  # ranks [0, cut) on the root, the rest on its child
        col = Collector([f"a|{i}" for i in range(n)], list(range(n)), list)
        port = mb.open_port(col)
        key = [port.addr, port.port_id]
        sent: list = []
        root, child = _agent_tree(sent)
        root.start({"g": key, "w": "gw", "t": [str(i) for i in range(cut)],
                    "c": [["child", {"t": [str(i) for i in range(cut, n)], "c": []}]] if cut < n else []})
        if cut < n:
            child.start({"g": key, "w": "gw", "u": "root", "t": [str(i) for i in range(cut, n)], "c": []})
        for r in rng.sample(range(n), n):
            v = values[r]
            reply = _reply(key, r, error=ValueError(f"rank {r}")) if v == ("error", None) else _reply(key, r, value=v)
            (root if r < cut else child).take(str(r), reply)
        merged = []  # the ranks of the agents' GatheredReplies entries

        def read(frame):
            if _wire.is_batch(frame):
                for part in _wire.unpack_batch(frame):
                    read(bytes(part))
                return
            t = _wire.loads_plain(frame) if not frame.startswith(_fanout.UP_MAGIC) else None
            if type(t) is tuple and t[0] == "\0replies":
                merged.extend(t[2])

        for _, frames in sent:
            frames = [bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames]
            for f in frames[1:]:
                read(f)
            mb._dispatch(frames)
        assert sorted(merged) == [r for r, v in enumerate(values) if v != ("error", None) and
                                  not (type(v) is tuple and v[:1] == ("frac",))]
        if ("error", None) in values:
            with pytest.raises(ValueError, match="rank"):
                col.future.get(timeout=1)
            return
        got = col.future.get(timeout=1)
        assert got == values and [type(v) for v in got] == [type(v) for v in values]

    mb = mailbox.Mailbox(io_thread=False)
    try:
        check()
    finally:
        mb.close()


# ---- reductions in the tree (Accumulator): pure, then on the job's agents ---------------------------------
def _fold_spec(combine, exact=None) -> dict:
    import base64

    import cloudpickle

    spec = {"f": base64.b64encode(cloudpickle.dumps(combine)).decode()}
    if exact is not None:
        spec["e"] = list(exact)
    return spec


def _folded_call(mb, n, groups, combine, spec, values, identity, fanout=2):
    """One folded call in one process: ``n`` places, ``groups`` (each: the places of one agent's procs, in any
    order), agents in a ``fanout``-ary tree in the order of ``groups`` as ``_fanout`` builds it, every proc's
    reply taken by its agent; what the root agents send up is dispatched to a ``FoldCollector``."""
    from monarch_tensor.hosts._gather import Gathers
    from monarch_tensor.transport._ports import FoldCollector

    col = FoldCollector([f"a|{i}" for i in range(n)], list(range(n)), identity, combine)
    port = mb.open_port(col)
    key = [port.addr, port.port_id]
    sent: list = []
    agents: list = []
    for i in range(len(groups)):
        parent = None if i < fanout else i // fanout - 1
        if parent is None:
            send = (lambda addr, frames: sent.append(frames))
        else:
            send = (lambda addr, frames, p=parent, i=i: agents[p].take(f"agent{i}", frames))
        agents.append(Gathers(send, 60.0, 600.0))

    def plan(i):
        kids = [j for j in range(len(groups)) if j >= fanout and j // fanout - 1 == i]
        return {"t": [str(p) for p in groups[i]], "p": list(groups[i]), "c": [[f"agent{j}", plan(j)] for j in kids]}

    for i, g in enumerate(agents):
        p = plan(i)
        p.update({"g": key, "w": "gw", "r": spec})
        if i >= fanout:
            p["u"] = f"agent{i // fanout - 1}"
        g.start(p)
    for i in reversed(range(len(groups))):  # leaves first: each agent's chunk goes up once its subtree answered
        for pos in groups[i]:
            agents[i].take(str(pos), _reply(key, pos, value=values[pos]))
    for frames in sent:
        mb._dispatch([bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames])
    return col, sent


def test_agents_fold_consecutive_places_and_the_result_is_the_rank_order_fold():
    """A non-commutative associative combine (string concatenation, declared associative): the root agents
    send one chunk each, mostly runs, and the result is exactly the local rank-order fold."""
    mb = mailbox.Mailbox(io_thread=False)
    try:
        values = [f"<{i}>" for i in range(24)]
        groups = [list(range(k * 3, k * 3 + 3)) for k in range(8)]  # 8 agents of 3 procs, fan-out 2: depth 3
        col, sent = _folded_call(mb, 24, groups, lambda a, b: a + b, _fold_spec(lambda a, b: a + b), values, "id")
        assert len(sent) == 2  # one chunk per root agent
        assert col.future.get(timeout=1) == "id" + "".join(values)
        assert col.folded == 24 and col.runs_seen <= 2 * 3  # each root's subtree: one run per tree level at most
    finally:
        mb.close()


def test_a_known_reduction_folds_only_where_exact_and_the_controller_folds_the_rest_in_order():
    """``max`` undeclared: ints fold in the agents, floats (a NaN among them: max is then order-sensitive) go up as
    they are; a declared combine that raises on an agent leaves those values to the controller, which raises."""
    import operator

    mb = mailbox.Mailbox(io_thread=False)
    try:
        for values in ([1, 5, 2.5, 3, float("nan"), 4, 7, 6], [float("nan"), 5, 2.5, 3, 1, 4, 9, 6]):
            col, _ = _folded_call(mb, 8, [[0, 1, 2, 3], [4, 5, 6, 7]], max, _fold_spec(max, ("int", "bool", "str")),
                                  values, 0)
            local = 0
            for v in values:
                local = max(local, v)
            got = col.future.get(timeout=1)
            assert got == local or (got != got and local != local)
            assert type(got) is type(local) and 0 < col.folded < 8
        col2, _ = _folded_call(mb, 4, [[0, 1], [2, 3]], operator.add, _fold_spec(operator.add), [1, 2, "x", 4], 0)
        with pytest.raises(TypeError):
            col2.future.get(timeout=1)
    finally:
        mb.close()


def test_a_fold_the_agents_cannot_unpickle_goes_up_unfolded():
    mb = mailbox.Mailbox(io_thread=False)
    try:
        spec = {"f": "bm90IGEgcGlja2xl"}  # base64 of b"not a pickle"
        col, _ = _folded_call(mb, 6, [[0, 1, 2], [3, 4, 5]], lambda a, b: a * b, spec, list(range(1, 7)), 1)
        assert col.future.get(timeout=1) == 720 and col.folded == 0
    finally:
        mb.close()


def test_folding_in_any_tree_equals_the_local_fold():
    """Property: any places split among agents in any order, any fan-out; 2x2 integer matrix products
    (associative, not commutative) folded in the tree equal the local fold."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    def matmul(a, b):
        return (a[0] * b[0] + a[1] * b[2], a[0] * b[1] + a[1] * b[3], a[2] * b[0] + a[3] * b[2],
                a[2] * b[1] + a[3] * b[3])

    spec = _fold_spec(matmul)

    @settings(max_examples=30, deadline=None)
    @given(st.integers(0, 2**32 - 1))
    def check(seed):
        import random

        rng = random.Random(seed)
        n = rng.randint(1, 30)
        values = [tuple(rng.randint(-3, 3) for _ in range(4)) for _ in range(n)]
        order = rng.sample(range(n), n)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 6))))
        groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        col, _ = _folded_call(mb, n, groups, matmul, spec, values, (1, 0, 0, 1), rng.randint(1, 3))
        local = (1, 0, 0, 1)
        for v in values:
            local = matmul(local, v)
        assert col.future.get(timeout=1) == local

    mb = mailbox.Mailbox(io_thread=False)
    try:
        check()
    finally:
        mb.close()


@pytest.fixture
def folds(monkeypatch):
    """What reaches this process's folding ports: ("runs", [(lo, hi)]) and ("values", ranks), in order."""
    seen = []
    runs, values, one = FoldCollector.deliver_runs, FoldCollector.deliver_values, FoldCollector.deliver

    def on_runs(self, rs):
        seen.append(("runs", [(lo, hi) for lo, hi, _ in rs]))
        return runs(self, rs)

    def on_values(self, ranks, vs):
        seen.append(("values", list(ranks)))
        return values(self, ranks, vs)

    def on_one(self, msg):
        seen.append(("value", msg.rank))
        return one(self, msg)

    monkeypatch.setattr(FoldCollector, "deliver_runs", on_runs)
    monkeypatch.setattr(FoldCollector, "deliver_values", on_values)
    monkeypatch.setattr(FoldCollector, "deliver", on_one)
    return seen


@pytest.mark.timeout(120)
def test_an_accumulator_folds_in_the_agents_one_value_per_root_agent(echo, folds, monkeypatch):
    """A user's associative, non-commutative combine: each root agent sends one folded value; with a chain
    (fan-out 1) the root folds its child's run into its own and the controller receives one value. The result
    equals the local fold of the same replies."""
    acc = Accumulator(echo.label, "", lambda a, b: a + b, associative=True)
    local = "".join(echo.label.call().get(timeout=30).values())
    assert acc.accumulate().get(timeout=30) == local == "<0><1><2><3>"
    assert sorted(folds) == [("runs", [(0, 1)]), ("runs", [(2, 3)])]  # one per root agent, nothing else
    folds.clear()
    monkeypatch.setattr(_fanout, "FANOUT", 1)
    assert acc.accumulate().get(timeout=30) == local
    assert folds == [("runs", [(0, 3)])]
    monkeypatch.setattr(_fanout, "FANOUT", 8)
    folds.clear()
    # undeclared and not a known reduction: folded on the controller, the same result
    assert Accumulator(echo.label, "", lambda a, b: a + b).accumulate().get(timeout=30) == local
    assert folds and all(kind != "runs" for kind, _ in folds)


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_fails_the_folded_call_naming_it(echo, tmp_path):
    import operator

    gate = str(tmp_path / "gate")
    acc = Accumulator(echo.fail_on, 0, operator.add, associative=True)
    with pytest.raises(ActorError, match="rank 2 fails") as e:  # rank 3 waits meanwhile: the error came alone
        acc.accumulate([2], gate).get(timeout=30)
    assert e.value.rank == 2
    open(gate, "w").close()
    with pytest.raises(ActorError, match="rank [03] fails"):
        acc.accumulate([0, 3]).get(timeout=30)
    assert acc.accumulate([]).get(timeout=30) == 0 + 1 + 2 + 3


@pytest.mark.timeout(120)
def test_messages_from_one_proc_follow_its_folded_reply_in_the_order_sent(echo, monkeypatch):
    """As for gathered replies: a proc's channel value for call i+1 never overtakes its reply to call i, which
    its agent holds in a run waiting for a slower peer."""
    order, made = [], []
    init, runs, values, receive = FoldCollector.__init__, FoldCollector.deliver_runs, FoldCollector.deliver_values, \
        Receiver.deliver

    def on_init(self, *a, **k):
        made.append(self)
        init(self, *a, **k)

    def on_runs(self, rs):
        order.extend(("reply", r, made.index(self)) for lo, hi, _ in rs for r in range(lo, hi + 1))
        return runs(self, rs)

    def on_values(self, ranks, vs):
        order.extend(("reply", r, made.index(self)) for r in ranks)
        return values(self, ranks, vs)

    def on_value(self, msg):
        order.append(("value", *msg.value))
        return receive(self, msg)

    monkeypatch.setattr(FoldCollector, "__init__", on_init)
    monkeypatch.setattr(FoldCollector, "deliver_runs", on_runs)
    monkeypatch.setattr(FoldCollector, "deliver_values", on_values)
    monkeypatch.setattr(Receiver, "deliver", on_value)
    port, recv = Channel.open()
    acc = Accumulator(echo.slice(hosts=0).emit, 0, lambda a, b: a + b, associative=True)
    futures = [acc.accumulate(port, i, 1) for i in range(10)]
    assert [f.get(timeout=30) for f in futures] == [2 * i for i in range(10)]
    for _ in range(20):
        recv.recv().get(timeout=30)
    for rank in (0, 1):
        mine = [e for e in order if e[1] == rank]
        assert mine == [e for i in range(10) for e in (("value", rank, i), ("reply", rank, i))]


def test_a_fold_collector_fails_on_a_death_or_a_run_over_an_answered_rank():
    from monarch_tensor.errors import ProtocolError
    from monarch_tensor.transport.messages import SendToPort

    col = FoldCollector(["a|0", "a|1", "b|0", "b|1"], [4, 5, 6, 7], 0, max)
    assert col.deliver_runs([(0, 1, 9)]) is False
    assert col.proc_died("a|0", SupervisionError("gone")) == (False, False)  # it answered: not this call's
    assert col.proc_died("b|0", SupervisionError("gone")) == (True, False)
    assert col.deliver(SendToPort(1, 3, None, 7)) is True  # the last rank: the port is done
    with pytest.raises(SupervisionError, match="gone"):
        col.future.get(timeout=1)
    col2 = FoldCollector(["a|0", "a|1", "b|0"], [0, 1, 2], 0, max)
    col2.deliver(SendToPort(1, 3, None, 1))
    assert col2.deliver_runs([(0, 1, 9)]) is True
    with pytest.raises(ProtocolError, match="rank 1, which answered already"):
        col2.future.get(timeout=1)



def test_a_collector_fails_only_the_ranks_a_dead_proc_still_owed():
    from monarch_tensor.transport.messages import SendToPort

    col = Collector(["a|0", "a|1", "b|0"], [4, 5, 6], list)
    assert col.addr_of(6) == "b|0" and col.addr_of(9) == ""
    assert col.deliver_values([5], [50]) is False
    assert col.proc_died("a|1", SupervisionError("gone")) == (False, False)  # it answered: not this call's
    assert col.proc_died("b|0", SupervisionError("gone")) == (True, False)
    assert col.deliver(SendToPort(1, 40, None, 4)) is True  # the last rank: the port is done
    with pytest.raises(SupervisionError, match="gone"):
        col.future.get(timeout=1)


def test_a_call_is_refused_at_the_first_rank_whose_proc_died_stopped_or_whose_actor_stopped():
    """``ActorMesh._check`` looks at a mesh's ranks in one go where nothing is amiss; where something is, the first
    rank it concerns says what, whether or not the mesh was called before (its addresses kept)."""
    import uuid

    from monarch_tensor.actor import ActorMesh
    from monarch_tensor.errors import ActorStoppedError, MeshStoppedError
    from monarch_tensor.hosts import host
    from monarch_tensor.hosts.local import ProcInfo
    from monarch_tensor.shape import Shape

    tag = uuid.uuid4().hex[:8]
    procs = [ProcInfo(f"tcp://check-{tag}-{i // 4}:1|{i % 4}", i) for i in range(8)]
    mesh = ActorMesh("echo", Echo, procs, Shape(("hosts", "gpus"), (2, 4)))
    part = mesh.slice(hosts=1)
    mesh._check("value")
    part._check("value")
    procs[6].alive, procs[6].exit_status = False, "exit 3"
    with pytest.raises(SupervisionError, match="rank 6"):
        mesh._check("value")
    with pytest.raises(SupervisionError, match="rank 6"):
        part._check("value")
    mesh.slice(hosts=0)._check("value")  # (not its ranks)
    procs[6].alive = True
    mailbox.current_mailbox().proc_died(procs[5].addr, SupervisionError(f"proc {tag} 5 lost"))
    with pytest.raises(SupervisionError, match=f"proc {tag} 5 lost"):
        mesh._check("value")
    mesh.slice(hosts=0)._check("value")
    mesh._stopped[2] = "done here"
    with pytest.raises(ActorStoppedError, match="done here"):
        mesh.slice(hosts=0)._check("value")
    host.stopped_addrs.add(procs[1].addr)
    try:
        with pytest.raises(MeshStoppedError):
            mesh.slice(hosts=0)._check("value")
    finally:
        host.stopped_addrs.discard(procs[1].addr)

# ---- spawns down the agent tree -------------------------------------------------------------------------
def test_a_spawn_plan_follows_the_tree_and_each_level_waits_longer_than_the_one_below():
    from monarch_tensor.hosts import _spawn_tree
    from monarch_tensor.hosts.agent_messages import SpawnProcs
    from monarch_tensor.transport.messages import PortRef

    agents = [f"tcp://plan-h{i}:1" for i in range(7)]
    for a in agents:
        _fanout.register(a, "plan-test")
    try:
        def part(h):
            return SpawnProcs("s", (2 * h, 2 * h + 1), ({}, {}), "ipc:///c", "tcp://gw:1", PortRef("ipc:///c", h))

        parts = {agents[h]: part(h) for h in (1, 2, 5, 6)}  # agent 0 only passes it on (fan-out 2: i // 2 - 1)
        roots = _spawn_tree.plan("s", parts, 60.0, slack=2.0, fanout=2)
        assert [(r, sorted(under)) for r, _, under in roots] == [
            (agents[1], [agents[1], agents[5]]), (agents[0], [agents[2], agents[6]])]
        one, zero = roots[0][1], roots[1][1]
        assert zero.spawn is None and [c for c, _ in zero.below] == [agents[2]]
        two = dict(zero.below)[agents[2]]
        assert two.spawn.ranks == (4, 5) and [c for c, _ in two.below] == [agents[6]]
        six = dict(two.below)[agents[6]]
        assert six.spawn.ranks == (12, 13) and six.below == ()
        assert one.spawn.ranks == (2, 3) and dict(one.below)[agents[5]].spawn.ranks == (10, 11)
        # a tree of depth 3: each level waits one slack longer than the level below it
        assert (zero.timeout, two.timeout, six.timeout, one.timeout) == (64.0, 62.0, 60.0, 64.0)
        assert _spawn_tree.request_timeout(roots, 60.0, slack=2.0) == 66.0
    finally:
        for a in agents:
            _fanout.forget(a)


def test_an_agent_answers_for_its_subtree_once_and_fails_a_silent_child_at_its_timeout():
    from monarch_tensor.errors import HostUnreachableError
    from monarch_tensor.hosts import _spawn_tree
    from monarch_tensor.hosts.agent_messages import ReportSpawned, SpawnProcs, SpawnTree
    from monarch_tensor.transport.messages import PortRef

    spawn = SpawnProcs("s", (0,), ({},), "ipc:///c", "tcp://gw:1", PortRef("ipc:///c", 1))
    def leaf(addr):
        return SpawnTree("s", addr, spawn, (), 5.0)

    quiet = SpawnTree("s", "tcp://d:1", None, (("tcp://e:1", leaf("tcp://e:1")), ("tcp://f:1", leaf("tcp://f:1"))), 5.0)
    tree = SpawnTree("s", "tcp://me:1", spawn, (("tcp://c:1", leaf("tcp://c:1")), ("tcp://d:1", quiet)), 10.0)
    passed, answers = [], []
    trees = _spawn_tree.SpawnTrees("tcp://me:1", lambda child, t: passed.append((child, t)))
    tid = trees.start(tree, answers.append)
    assert [(c, t.reply_to) for c, t in passed] == [("tcp://c:1", ("tcp://me:1", tid)), ("tcp://d:1", ("tcp://me:1", tid))]
    ok = ReportSpawned(("tcp://c:1|1",), (77,))
    trees.child_done(tid, "tcp://c:1", (("tcp://c:1", ok, None),))
    trees.own_done(tid, ok, None)
    trees.expire(time.monotonic())
    assert answers == []  # the quiet child still has time
    trees.expire(time.monotonic() + 10.5)
    assert len(answers) == 1 and not trees.pending
    got = {a: (r, e) for a, r, e in answers[0]}
    assert got["tcp://c:1"] == (ok, None) and got["tcp://me:1"] == (ok, None)
    assert set(got) == {"tcp://me:1", "tcp://c:1", "tcp://e:1", "tcp://f:1"}  # (d spawns nothing itself)
    assert isinstance(got["tcp://e:1"][1], HostUnreachableError) and "through tcp://d:1" in str(got["tcp://e:1"][1])
    trees.child_done(tid, "tcp://d:1", ())  # a late answer is dropped
    assert len(answers) == 1


def _live(agent) -> int:
    """The procs an agent runs (every session's)."""
    from monarch_tensor.hosts.agent_messages import OpenSession
    from monarch_tensor.hosts.remote_hosts import SESSION

    return agent.request(OpenSession(SESSION), timeout=10).procs


def _chain(job) -> list:
    """The job's live agents in the order of its tree (with fan-out 1, a chain: each the child of the one before)."""
    st = job.state()
    mine = {a.addr: a for m in (st.hosts, st.spare, st.doomed) for a in m._agents if not a.lost}
    return [mine[a] for a in _fanout._trees[next(iter(mine.values())).keys.public] if a in mine]


@pytest.mark.timeout(120)
def test_a_spawn_goes_down_the_agent_tree_and_each_rank_gets_its_place(job, monkeypatch, chunks):
    """A chain of the job's agents (fan-out 1); the mesh leaves out the first, which only passes the spawn on. The
    controller sends one request, to that first agent; the actors' spawn goes down the same tree, its acks
    gathered; every rank runs on its own host's agent, at its coordinates."""
    from monarch_tensor.hosts import remote_hosts
    from monarch_tensor.hosts.remote_hosts import RemoteHostMesh

    monkeypatch.setattr(_fanout, "FANOUT", 1)
    chain = _chain(job)
    assert len(chain) >= 3
    sent = []
    request = remote_hosts.AgentClient.request

    def spy(self, msg, *a, **k):
        sent.append((self.addr, type(msg).__name__))
        return request(self, msg, *a, **k)

    monkeypatch.setattr(remote_hosts.AgentClient, "request", spy)
    hosts = RemoteHostMesh(chain[1:])
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    try:
        assert sent == [(chain[0].addr, "SpawnTree")]
        got = procs.spawn("where", Echo).where.call().get(timeout=60).values()
        n = 2 * len(chain[1:])
        assert [(r, coords) for r, coords, _ in got] == [(r, {"hosts": r // 2, "gpus": r % 2}) for r in range(n)]
        assert [agent for _, _, agent in got] == [chain[1 + r // 2].info.addr for r in range(n)]
        assert [p.rank for p in procs._procs] == list(range(n))
        assert [sorted(ranks) for ranks, _ in chunks] == [list(range(n))] * 2  # the spawn's acks, the call's replies
    finally:
        procs.stop().get(timeout=30)


def _template_of(agent_pid: int) -> int:
    """The pid of a host agent's template process (its child that runs ``_zygote``)."""
    import glob

    for path in glob.glob(f"/proc/{agent_pid}/task/*/children"):
        for pid in open(path).read().split():
            if "_zygote" in open(f"/proc/{pid}/cmdline").read():
                return int(pid)
    raise AssertionError(f"no template process under agent {agent_pid}")


@pytest.mark.timeout(120)
def test_a_spawn_that_fails_on_one_agent_names_its_ranks_and_cancels_the_others(job, monkeypatch):
    """The doomed host's template process is killed: a spawn across it and a healthy host (down a chain) fails
    with that agent's error, naming it and its ranks; the healthy host's procs of that spawn are killed."""
    from monarch_tensor.hosts.remote_hosts import RemoteHostMesh

    monkeypatch.setattr(_fanout, "FANOUT", 1)
    st = job.state()
    host, doomed = st.hosts._agents[0], st.doomed._agents[0]
    before = _live(host)
    os.kill(_template_of(job.pids[3]), signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"spawn_procs failed on host agent {doomed.addr} \(ranks 2-3\): .*template"):
        RemoteHostMesh([host, doomed]).spawn_procs(per_host={"gpus": 2})
    _wait_for_value(lambda: _live(host) == before)
    assert _live(host) == before


@pytest.mark.timeout(120)
def test_an_agent_lost_during_a_spawn_fails_it_at_once_naming_that_agent(job, monkeypatch):
    """The doomed host's agent is killed as a spawn goes down a chain to it: the spawn fails with a supervision
    error naming it within seconds (not at the spawn timeout); the healthy host's procs of that spawn are killed."""
    from monarch_tensor import config
    from monarch_tensor.hosts.remote_hosts import RemoteHostMesh

    monkeypatch.setattr(_fanout, "FANOUT", 1)
    st = job.state()
    host, doomed = st.hosts._agents[0], st.doomed._agents[0]
    before = _live(host)
    os.kill(job.pids[3], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match=f"host agent {doomed.addr} was lost"):
        RemoteHostMesh([host, doomed]).spawn_procs(per_host={"gpus": 2})
    assert time.monotonic() - t0 < config.get("spawn_timeout") / 2
    _wait_for_value(lambda: _live(host) == before)
    assert _live(host) == before
