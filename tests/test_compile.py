"""compile (Monarch's): trace rules, bit-equality with uncompiled training steps, one message per mesh per
replay, errors inside a replay, flat memory over many replays, programs freed with their function."""

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from monarch_tensor.controller import compile as C
from monarch_tensor.controller.api import client_for, worker_stats
from monarch_tensor.controller.errors import MeshTensorError, RemoteException

from monarch_tensor import compile, fetch_shard

GPUS = 2


@pytest.fixture(scope="module")
def mesh():
    from monarch_tensor import this_host

    m = this_host().spawn_procs(per_host={"gpus": GPUS})
    yield m
    m.stop()


def counts():
    return dict(C.stats)


def delta(before):
    return {k: C.stats[k] - before[k] for k in before}


def value(t):
    return fetch_shard(t, gpus=0).result(60)


def test_trace_rules(mesh):
    with mesh.activate():
        w = torch.ones(4)

        @compile(verify=False)
        def f(x, k):
            return x * w + k

        x = torch.arange(4.0)
        b = counts()
        r1, r2 = f(x, 1), f(x, 1)
        assert delta(b) == {"recordings": 1, "replays": 1}
        assert torch.equal(value(r2), torch.arange(4.0) + 1)
        b = counts()
        r3 = f(x, 2)  # a changed non-tensor value: records anew
        assert delta(b) == {"recordings": 1, "replays": 0}
        assert torch.equal(value(r3), torch.arange(4.0) + 2)
        b = counts()
        r4 = f(torch.arange(6.0).reshape(2, 3)[:, :2].reshape(4), 1)  # same sizes, other metadata? same: replay
        r5 = f(torch.ones(2, 4), 1)  # other sizes: records anew
        r6 = f(torch.ones(4, dtype=torch.float64), 1)  # other dtype: records anew
        assert delta(b)["recordings"] == 2
        assert torch.equal(value(r4), torch.tensor([0.0, 1.0, 3.0, 4.0]) + 1)
        assert torch.equal(value(r5), torch.full((2, 4), 2.0))
        assert value(r6).dtype == torch.float64
        b = counts()
        w.mul_(3)  # a captured tensor changed in place: the replay reads its new value
        assert torch.equal(value(f(x, 1)), torch.arange(4.0) * 3 + 1)
        assert delta(b) == {"recordings": 0, "replays": 1}
        assert r1.shape == r2.shape == (4,)


def test_aliasing_pattern_is_part_of_the_key(mesh):
    with mesh.activate():
        @compile(verify=False)
        def f(a, b):
            a.add_(1)
            return a + b

        x, y = torch.zeros(3), torch.zeros(3)
        f(x, y), f(x, y)
        b = counts()
        r = f(x, x)  # both arguments one tensor: a new recording, and the eager result
        assert delta(b)["recordings"] == 1
        assert torch.equal(value(r), torch.full((3,), 6.0))


def test_autocast_is_part_of_the_key(mesh):
    with mesh.activate():
        @compile(verify=False)
        def f(x):
            return x @ x

        a = torch.ones(4, 4)
        f(a), f(a)
        b = counts()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r, r2 = f(a), f(a)
        assert delta(b) == {"recordings": 1, "replays": 1}
        assert r.dtype == r2.dtype == value(r2).dtype == torch.bfloat16
        assert f(a).dtype == torch.float32 and delta(b)["replays"] == 2


def test_views_at_moving_offsets_record_anew_and_say_so(mesh):
    with mesh.activate():
        @compile(verify=False)
        def f(x):
            return x * 2

        xs = torch.arange(12.0).reshape(4, 3)
        b = counts()
        with pytest.warns(UserWarning, match=r"records anew on every call.*xs\[i\]\.clone\(\)"):
            rows = [f(xs[i]) for i in range(4)]
        assert delta(b) == {"recordings": 4, "replays": 0}
        assert [value(r).tolist() for r in rows] == (torch.arange(12.0).reshape(4, 3) * 2).tolist()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per function; whole tensors replay
            f(xs[0])
            y = torch.ones(3)
            f(y), f(y)


def test_verify_names_the_line_where_recordings_diverge(mesh):
    scale = [1.0]
    with mesh.activate():
        @compile
        def f(x):
            y = x + 1
            return y * scale[0]  # the line the error names

        x = torch.ones(2)
        f(x)
        scale[0] = 2.0
        with pytest.raises(MeshTensorError, match=r"test_compile.py:\d+ in f.*failed to verify|failed to verify.*"
                                                   r"aten::mul.*test_compile.py:\d+ in f"):
            f(x)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _step(model, opt):
    """A training step of ``model`` (cross entropy) with ``opt``, returning its loss."""
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _train(model, opt, batches, dp: bool, fn_wrap=lambda f: f, sched=None):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if dp:
            for p in model.parameters():
                p.grad.reduce_("gpus", "avg")
        opt.step()
        return loss

    step = fn_wrap(step)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        if sched is not None:
            sched.step()
    return [value(t) for t in losses], [value(p) for p in model.parameters()]


def _batches(n):
    return [(torch.randn(6, 8) + torch.ones(6, 8) * 0, torch.randint(0, 4, (6,))) for _ in range(n)]


@pytest.mark.parametrize("optim", ["sgd", "adamw_fused"])
def test_training_step_equals_uncompiled_bit_for_bit(mesh, optim):
    with mesh.activate():
        torch.manual_seed(1)
        batches = _batches(9)

        def make(seed):
            model = _model(seed)
            if optim == "sgd":
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
            return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

        m1, o1, s1 = make(0)
        eager = _train(m1, o1, batches, dp=True, sched=s1)
        m2, o2, s2 = make(0)
        b = counts()
        comp = _train(m2, o2, batches, dp=True, fn_wrap=compile, sched=s2)
        assert delta(b)["replays"] >= 2
        for a, c in zip(eager[0] + eager[1], comp[0] + comp[1]):
            assert torch.equal(a, c)
        if optim == "adamw_fused":
            assert torch.equal(value(o1.state[next(m1.parameters())]["step"]),
                               value(o2.state[next(m2.parameters())]["step"]))


def test_adam_reading_its_step_on_the_controller_runs_uncompiled(mesh):
    with mesh.activate():
        torch.manual_seed(2)
        batches = _batches(3)
        m1 = _model(0)
        eager = _train(m1, torch.optim.AdamW(m1.parameters(), lr=0.01), batches, dp=False)
        m2 = _model(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comp = _train(m2, torch.optim.AdamW(m2.parameters(), lr=0.01), batches, dp=False, fn_wrap=compile)
        assert any("runs uncompiled" in str(w.message) and "fused=True" in str(w.message) for w in caught)
        for a, c in zip(eager[0] + eager[1], comp[0] + comp[1]):
            assert torch.equal(a, c)


def test_one_message_per_proc_per_replay(mesh):
    with mesh.activate():
        model = _model(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batches(1)[0]

        step = compile(_step(model, opt), verify=False)

        for _ in range(4):
            step(x, y)
        client = client_for(mesh)
        client.flush()
        before = client.messages
        b = counts()
        loss = step(x, y)
        client.flush()
        assert delta(b) == {"recordings": 0, "replays": 1}
        assert client.messages - before == GPUS
        assert torch.isfinite(value(loss))


def test_fetch_inside_is_refused_at_its_line(mesh):
    with mesh.activate():
        @compile
        def f(x):
            return fetch_shard(x + 1).result()

        with pytest.raises(MeshTensorError, match=r"inside a compiled function.*test_compile.py:\d+"):
            f(torch.ones(2))


def test_an_error_in_a_replay_is_a_value_naming_the_recorded_line(mesh):
    with mesh.activate():
        table = torch.arange(10.0)

        @compile(verify=False)
        def lookup(i):
            return torch.index_select(table, 0, i) * 2  # the line the error names

        good = torch.tensor([1, 2])
        lookup(good), lookup(good)
        b = counts()
        bad = lookup(torch.tensor([1, 99]))
        assert delta(b)["replays"] == 1
        with pytest.raises(RemoteException, match=r"test_compile.py:\d+"):
            value(bad)
        assert torch.equal(value(lookup(good)), torch.tensor([2.0, 4.0]))  # the mesh stays usable


def test_a_failure_inside_or_into_a_replay_fails_only_what_reads_it(mesh):
    """A replay's ops run as generated straight-line source; one that raises, or an input that holds a failure,
    fails exactly the results that depend on it (naming the user's line, with no frame of the generated source),
    and the rest compute as the uncompiled ops would."""
    with mesh.activate():
        table = torch.arange(10.0)

        @compile(verify=False)
        def f(i, x):
            a = x + 1
            b = torch.index_select(table, 0, i)  # the line the error names
            c = b * 2
            d = (a * 3).reshape(2, 1) + 0
            return c, d

        good, x = torch.tensor([1, 2]), torch.ones(2)
        f(good, x), f(good, x)
        b = counts()
        c, d = f(torch.tensor([1, 99]), x)
        assert delta(b)["replays"] == 1
        with pytest.raises(RemoteException, match=r"test_compile.py:\d+") as e:
            value(c)
        assert "index_select" in e.value.op and "program>" not in e.value.traceback
        assert torch.equal(value(d), torch.full((2, 1), 6.0))

        failed_x = torch.index_select(table, 0, torch.tensor([98, 99]))  # a tensor holding a failure
        b = counts()
        c, d = f(good, failed_x)
        assert delta(b)["replays"] == 1
        assert torch.equal(value(c), torch.tensor([2.0, 4.0]))
        with pytest.raises(RemoteException, match="index_select"):
            value(d)
        c, d = f(good, x)  # and the next replay is whole again
        assert torch.equal(value(c), torch.tensor([2.0, 4.0])) and torch.equal(value(d), torch.full((2, 1), 6.0))


def _all_reduce_unless(t, group, fail, how):
    """All-reduces ``t`` over ``group``, except where ``fail`` is set on rank gpus=1: that rank raises first
    (``how`` "raise") or returns without it ("return")."""
    from monarch_tensor.actor import current_rank

    if bool(fail) and current_rank()["gpus"] == 1:
        if how == "return":
            return t.clone()
        raise ValueError("rank gpus=1 raises before its all-reduce")
    out = t.clone()
    torch.distributed.all_reduce(out, group=group)
    return out


@pytest.mark.parametrize("how", ["raise", "return"])
def test_a_rank_that_skips_a_collective_in_a_replay_fails_its_peer_and_the_next_reduce_is_right(mesh, how):
    """In a replay, a remote function that skips its all-reduce on one rank (it raises before it, or returns
    without it) fails that call on the other rank, and the program's next collective, a ``reduce_``, pairs
    the right tensors: it paired with the skipped all-reduce, silently. (Each step of a program tags its
    collectives: the two are steps of one instruction.)"""
    from monarch_tensor import remote

    fn = remote(_all_reduce_unless, propagate=lambda t, group, fail, how: t.clone())
    group = mesh.process_group("gpus")
    with mesh.activate():
        rank = mesh.rank_tensor("gpus").float()
        x, y0 = torch.full((3,), 10.0) + rank, torch.full((3,), 100.0) + rank

        @compile(verify=False)
        def step(x, y, fail):
            a = fn(x, group, fail, how)
            y = y * 1
            y.reduce_("gpus", "sum")
            return a, y

        no, yes = torch.zeros(()), torch.ones(())
        step(x, y0, no), step(x, y0, no)
        b = counts()
        a, y = step(x, y0, yes)
        assert delta(b)["replays"] == 1
        for g in range(GPUS):
            assert torch.equal(fetch_shard(y, gpus=g).result(60), torch.full((3,), 201.0))
        with pytest.raises(RemoteException, match="member 1 of this group ended this call"):
            value(a)
        if how == "raise":
            with pytest.raises(RemoteException, match="raises before its all-reduce"):
                fetch_shard(a, gpus=1).result(60)
        else:
            assert torch.equal(fetch_shard(a, gpus=1).result(60), torch.full((3,), 11.0))
        a, y = step(x, y0, no)  # and the group is in step for the next replay
        assert torch.equal(value(a), torch.full((3,), 21.0)) and torch.equal(value(y), torch.full((3,), 201.0))


def test_memory_is_flat_over_many_replays_and_programs_are_freed(mesh):
    with mesh.activate():
        w = torch.ones(8)

        @compile(verify=False)
        def f(x):
            h = x * w
            return (h + 1).sum()

        x = torch.ones(8)
        f(x), f(x)
        value(f(x))
        gc.collect()
        client_for(mesh).flush_deletes()  # deletes still batched on the controller would count in `before`
        before = worker_stats(mesh)["refs"]
        b = counts()
        for _ in range(10_000):
            r = f(x)
        assert delta(b)["replays"] == 10_000
        assert value(r).item() == 16.0
        del r
        gc.collect()
        client_for(mesh).flush_deletes()
        assert worker_stats(mesh)["refs"] == before
        del f
        gc.collect()
        client_for(mesh).flush_deletes()
        # the program itself is freed (a program of an earlier test collected in the same pass may go too)
        assert worker_stats(mesh)["refs"] <= before - 1


def test_monarch_path():
    from monarch_tensor.common._coalescing import compile as monarch_compile

    assert monarch_compile is compile


def test_a_constant_written_in_place_starts_afresh_each_replay(mesh):
    with mesh.activate():
        @compile(verify=False)
        def f(x):
            c = torch.tensor([1.0, 2.0])
            c.add_(x)
            return c * 1

        x = torch.ones(2)
        b = counts()
        rs = [f(x) for _ in range(4)]
        assert delta(b) == {"recordings": 1, "replays": 3}
        for r in rs:
            assert torch.equal(value(r), torch.tensor([2.0, 3.0]))


def test_sharded_training_step_equals_uncompiled(mesh):
    from monarch_tensor import module_to_mesh

    with mesh.activate():
        torch.manual_seed(4)
        batches = _batches(5)

        def make():
            model = module_to_mesh(_model(0), mesh)
            return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        m1, o1 = make()
        m2, o2 = make()

        def train(model, opt, wrap):
            step = wrap(_step(model, opt))
            return [step(x, y) for x, y in batches]

        eager = train(m1, o1, lambda f: f)
        b = counts()
        comp = train(m2, o2, compile)
        assert delta(b)["replays"] >= 2
        for a, c in zip(eager, comp):  # (a distributed loss: fetched whole)
            va, vc = fetch_shard(a).result(60), fetch_shard(c).result(60)
            va, vc = (v.to_local() if hasattr(v, "to_local") else v for v in (va, vc))  # (a DTensor's loss)
            assert torch.equal(va, vc)
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1.full_tensor(), p2.full_tensor())


def test_global_tensors_stay_global_and_their_layout_is_part_of_the_key(mesh):
    """A replay's DTensor results are DTensors laid out as the recording's (a Partial sum stays one: read as a
    plain tensor it would be one rank's addend); an argument of the same local metadata laid out otherwise
    (Partial instead of Replicate) records anew."""
    from monarch_tensor import Partial, Replicate, Shard, distribute, from_local

    with mesh.activate():
        @compile(verify=False)
        def f(x):
            return (x * 2).sum(), x + 1

        full = torch.arange(8.0)
        row = distribute(full, mesh, [Shard(0)])
        b = counts()
        for _ in range(3):
            total, plus = f(row)
        assert delta(b) == {"recordings": 1, "replays": 2}
        assert total.placements == (Partial(),) and plus.placements == (Shard(0),)
        assert total.full_tensor().item() == 56.0 and torch.equal(plus.full_tensor(), full + 1)
        rep = distribute(full, mesh, [Replicate()])
        f(rep)
        b = counts()
        total, _ = f(rep)
        assert delta(b) == {"recordings": 0, "replays": 1} and total.full_tensor().item() == 56.0
        part = from_local(torch.arange(8.0), mesh, [Partial()])  # each rank's addend: the whole is twice arange
        total, _ = f(part)
        assert delta(b) == {"recordings": 1, "replays": 1}
        assert total.full_tensor().item() == 112.0


def _guarded_changes(model, opt, kept, data):
    """(what, change, whether the next call must record anew) for changes made between calls of a compiled
    training step: the guards' epoch lets a replay skip its per-tensor guards only while none of these happened."""
    w0, b0, w2, b2 = model[0].weight, model[0].bias, model[2].weight, model[2].bias
    x, y = data

    def outside_backward(create_graph=False, inputs=None):
        # (accumulates into the existing grads: in place, or with create_graph=True, as new tensors autograd binds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's, on create_graph=True: a reference cycle)
            F.cross_entropy(model(x), y).backward(create_graph=create_graph, inputs=inputs)

    return [
        ("nothing", lambda: None, False),
        ("zero_grad(set_to_none=False)", lambda: opt.zero_grad(set_to_none=False), False),
        ("a backward outside the step", outside_backward, False),
        ("a backward outside the step, create_graph=True", lambda: outside_backward(True), True),
        ("a .grad held, then replaced by autograd", lambda: (kept.append(w0.grad), outside_backward(True, [w0])),
         True),  # (its refcount unchanged)
        ("a .grad read, not held", lambda: b2.grad.shape, False),
        ("zero_grad()", lambda: opt.zero_grad(), True),
        ("a .grad replaced", lambda: setattr(b0, "grad", torch.zeros_like(b0)), True),
        ("a .grad deleted", lambda: delattr(w2, "grad"), True),
        ("a .grad held by the script", lambda: kept.append(b2.grad), True),
        ("a .grad's data replaced", lambda: setattr(w2.grad, "data", torch.ones_like(w2)), True),
        ("a parameter's data replaced", lambda: setattr(w0, "data", w0.detach() * 0.5), True),
        ("a parameter frozen", lambda: b0.requires_grad_(False), True),
        ("a parameter unfrozen", lambda: setattr(b0, "requires_grad", True), True),
        ("a module's parameter swapped", lambda: setattr(model[2], "weight", torch.nn.Parameter(w2.detach() * 2)),
         True),
        ("the learning rate changed", lambda: opt.param_groups[0].__setitem__("lr", 0.05), True),
        ("a parameter removed from the optimizer, in place", lambda: opt.param_groups[0]["params"].pop(), True),
        ("a param group's list replaced by one of the same parameters",
         lambda: opt.param_groups[0].__setitem__("params", list(opt.param_groups[0]["params"])), False),
        ("a param group's list replaced by one with another parameter",
         lambda: opt.param_groups[0].__setitem__("params", [torch.nn.Parameter(w0.detach() * 2),
                                                            *opt.param_groups[0]["params"][1:]]), True),
        ("a parameter swapped in the optimizer only",
         lambda: opt.param_groups[0]["params"].__setitem__(0, torch.nn.Parameter(w0.detach() * 3)), True),
    ]


def _run_with_changes(wrap, data, batches):
    """Trains with a step wrapped by ``wrap``, making each of ``_guarded_changes`` before one call; the values of
    losses, parameters, gradients and tensors kept, and per change (what, records, counts of that call)."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept: list = []
    changes = _guarded_changes(model, opt, kept, data)

    step = wrap(_step(model, opt))
    losses, after = [], []
    for i, (x, y) in enumerate(batches):  # (one call site: a recording names its caller's line)
        k, r = divmod(i - 4, 3)  # a change before every third call, from the fifth on (the fourth replays)
        if i >= 4 and r == 0:
            what, change, records = changes[k]
            change()
            b = counts()
        losses.append(step(x, y))
        if i >= 4 and r == 0:
            after.append((what, records, delta(b)))
    return ([value(t) for t in losses], [value(p) for p in model.parameters()],
            [None if p.grad is None else value(p.grad) for p in model.parameters()], [value(t) for t in kept], after)


def test_guards_follow_changes_between_replays_bit_for_bit(mesh):
    """Each change between calls: the next call records anew where a replay would not do what the function does
    (else it replays), and losses, parameters, gradients and tensors the script kept equal the uncompiled run's."""
    with mesh.activate():
        torch.manual_seed(6)
        data = _batches(1)[0]
        batches = _batches(4 + 3 * 20)
        l1, p1, g1, k1, _ = _run_with_changes(lambda f: f, data, batches)
        l2, p2, g2, k2, after = _run_with_changes(compile, data, batches)
        assert len(after) == 20
        for what, records, d in after:
            assert d == ({"recordings": 1, "replays": 0} if records else {"recordings": 0, "replays": 1}), what
        assert len(k1) == len(k2) == 2
        for a, c in zip(l1 + p1 + k1, l2 + p2 + k2):
            assert torch.equal(a, c)
        assert [g is None for g in g1] == [g is None for g in g2]
        for a, c in zip(g1, g2):
            assert a is None or torch.equal(a, c)


@pytest.mark.parametrize("stored", ["one", "all"])
def test_a_gradient_the_function_stored_and_the_script_takes_from_there_records_anew(mesh, stored):
    """A replay skips the reference counts of its parameters' gradients until a ``.grad`` is read; a gradient
    the function also stored elsewhere (a dict; or all of them) is counted on every call: the script may take it from there
    without reading ``.grad``, and the next call then records anew (a replay would write the new gradient
    into the tensor the script holds), as its values equal the uncompiled run's."""
    def run(wrap):
        model = _model(11)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stash: dict = {}
        step = _step(model, opt)

        def storing(x, y):
            loss = step(x, y)
            if stored == "one":
                stash["w"] = model[0].weight.grad
            else:  # (every gradient held alike: as many references to each)
                stash["w"], stash["rest"] = model[0].weight.grad, [p.grad for p in model.parameters()][1:]
            return loss

        f = wrap(storing)
        kept, after = [], []
        for i, (x, y) in enumerate(_batches(8)):
            if i == 5:
                kept.append(stash["w"])  # (no .grad read)
                b = counts()
            f(x, y)
            if i == 5:
                after.append(delta(b))
        return [value(t) for t in kept], [value(p) for p in model.parameters()], after

    with mesh.activate():
        k1, p1, _ = run(lambda fn: fn)
        k2, p2, after = run(compile)
        assert after == [{"recordings": 1, "replays": 0}]
        for a, c in zip(k1 + p1, k2 + p2):
            assert torch.equal(a, c)


def test_a_param_list_the_script_holds_keeps_reaching_the_optimizer(mesh):
    """A param group's ``params`` list the script holds (``plist = opt.param_groups[0]["params"]``) stays the
    optimizer's own: changed through ``plist``, the optimizer steps the new set, compiled as uncompiled."""
    with mesh.activate():
        torch.manual_seed(8)
        batches = _batches(9)

        def run(wrap):
            model = _model(0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            plist = opt.param_groups[0]["params"]
            step = wrap(_step(model, opt))
            losses, made = [], []
            for i, (x, y) in enumerate(batches):
                if i == 6:
                    plist.pop()  # the last bias is no longer stepped
                    b = counts()
                losses.append(step(x, y))
                if i == 6:
                    made.append(delta(b))
            assert opt.param_groups[0]["params"] is plist
            return [value(t) for t in losses], [value(p) for p in model.parameters()], made

        l1, p1, _ = run(lambda f: f)
        l2, p2, made = run(compile)
        assert made == [{"recordings": 1, "replays": 0}]
        for a, c in zip(l1 + p1, l2 + p2):
            assert torch.equal(a, c)


def test_a_dropped_parameter_or_no_grad_fails_as_uncompiled(mesh):
    with mesh.activate():
        model = _model(7)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batches(1)[0]

        step = compile(_step(model, opt))

        for _ in range(4):
            step(x, y)
        b = counts()
        with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
            step(x, y)  # (the grad mode is part of the key: recorded, so backward() raises as uncompiled)
        assert delta(b) == {"recordings": 1, "replays": 0}
        b = counts()
        for _ in range(3):  # (zero_grad() ran before backward() raised: the grads are new again)
            step(x, y)
        assert delta(b)["replays"] == 1
        model[0].bias.drop()
        b = counts()
        with pytest.raises(MeshTensorError):  # (as the function's own call raises it)
            step(x, y)
        assert delta(b) == {"recordings": 1, "replays": 0}
        model[0].bias = torch.nn.Parameter(torch.zeros(16))
        for _ in range(3):
            step(x, y)
        del model[0].bias  # (torch has no hook for it)
        with pytest.raises(AttributeError, match="bias"):
            step(x, y)
