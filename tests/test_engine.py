"""The tensor engine on real procs: recording, fetch, collectives, errors, lifetimes.

One mesh of two procs (``{"gpus": 2}``) is shared by the whole module.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import os
import sys
import threading
import time
import types

import pytest
import torch
from _device import WORKER_DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monarch_tensor.controller.api import worker_stats

from monarch_tensor import MeshTensorError, RemoteException, fetch_shard, inspect, no_mesh, remote, this_host
from monarch_tensor.actor import Actor, ActorError, as_endpoint, current_rank, endpoint

pytestmark = pytest.mark.timeout(120)


def test_rank_tensor_reduce_fetch(procs):
    with procs.activate():
        x = torch.ones(4) + procs.rank_tensor("gpus")
        y = x.reduce("gpus", "sum")
        y0 = fetch_shard(y, gpus=0).result(timeout=60)
        x1 = fetch_shard(x, gpus=1).result(timeout=60)
        x0 = inspect(x, gpus=0)
        r1 = inspect(procs.rank("gpus"), gpus=1)
    assert torch.equal(y0, torch.full((4,), 3.0))
    assert torch.equal(x1, torch.full((4,), 2.0))
    assert torch.equal(x0, torch.ones(4))
    assert torch.equal(r1, torch.tensor(1))


def _my_rank_tensor(x):
    return x + current_rank().rank


my_rank_tensor = remote(_my_rank_tensor, propagate=lambda x: x)


def test_a_remote_function_sees_its_workers_rank(procs):
    """Remote functions run on the workers' stream threads, in the worker actor's context."""
    with procs.activate():
        got = my_rank_tensor(torch.zeros(2))
        assert [inspect(got, gpus=r).tolist() for r in (0, 1)] == [[0.0, 0.0], [1.0, 1.0]]


def test_new_float_scalars_on_pointwise_ops_need_no_new_propagation(procs):
    from monarch_tensor.controller import tensor as ct

    with procs.activate():
        x = torch.randn(3, 5)  # made on the workers: no value known here
        ref = fetch_shard(x, gpus=1).result(timeout=60)
        y = x
        ys = []
        for i in range(6):  # an optimizer's step size changes every step
            y = torch.addcmul(y, x, x, value=0.1 * (i + 1)) * (1.5 + i)
            ys.append(y)
        misses = ct.stats["misses"]
        for i in range(6, 12):
            y = torch.addcmul(y, x, x, value=0.1 * (i + 1)) * (1.5 + i)
        assert ct.stats["misses"] == misses  # the float values were not part of the cache key
        got = fetch_shard(y, gpus=1).result(timeout=60)
        with pytest.raises(RuntimeError, match="must match the size of tensor b"):
            torch.arange(0.0, 2.5) + x  # a float that is a size elsewhere still propagates (and fails)
    want = ref
    for i in range(12):
        want = torch.addcmul(want, ref, ref, value=0.1 * (i + 1)) * (1.5 + i)
    assert torch.allclose(got, want)


def test_new_int_scalars_on_pointwise_ops_need_no_new_propagation(procs):
    """``x + i`` in a loop over ``i`` made a cache entry per value (memory never freed)."""
    from monarch_tensor.controller import tensor as ct

    with procs.activate():
        x = torch.arange(4, dtype=torch.int64) + procs.rank_tensor("gpus")
        y = (x + 1) * 1
        misses = ct.stats["misses"]
        for i in range(2, 40):
            y = (x + i) * i
        assert ct.stats["misses"] == misses
        assert y.dtype == torch.int64
        got = [inspect(y, gpus=r) for r in (0, 1)]
        u = torch.zeros(3, dtype=torch.uint8) + 250  # (an int's kind, not its value, decides the dtype)
        assert u.dtype == torch.uint8 and inspect(u).tolist() == [250] * 3
    assert [g.tolist() for g in got] == [[(k + r + 39) * 39 for k in range(4)] for r in (0, 1)]


def test_new_scalar_lists_on_foreach_ops_need_no_new_propagation(procs):
    """A ``_foreach_`` op's list of scalars (foreach AdamW's per-parameter step sizes, new every step) is not part
    of the cache key; the values still reach the workers. Checked on foreach AdamW against local torch."""
    from monarch_tensor.controller import tensor as ct

    torch.manual_seed(0)
    init = [torch.randn(3, 4), torch.randn(5)]
    local = [p.clone().requires_grad_(True) for p in init]
    opt = torch.optim.AdamW(local, lr=0.1, foreach=True)
    for _ in range(4):
        sum((p * p).sum() for p in local).backward()
        opt.step()
        opt.zero_grad()
    with procs.activate():
        ps = [torch.zeros(p.shape).requires_grad_(True) for p in init]
        with torch.no_grad():
            for p, v in zip(ps, init):
                p.copy_(v)
        opt = torch.optim.AdamW(ps, lr=0.1, foreach=True)
        for step in range(4):
            if step == 2:
                misses = ct.stats["misses"]
            sum((p * p).sum() for p in ps).backward()
            opt.step()
            opt.zero_grad()
        assert ct.stats["misses"] == misses
        got = [inspect(p.detach(), gpus=1) for p in ps]
    assert all(torch.allclose(g, want.detach(), atol=1e-6) for g, want in zip(got, local))


def test_set_default_dtype_reaches_the_workers(procs):
    """Factories and type promotion follow torch.set_default_dtype() on the workers as here (they kept
    float32, and a cached propagation of ``torch.ones(2)`` kept it here too)."""
    try:
        with procs.activate():
            a = torch.ones(2)
            torch.set_default_dtype(torch.float64)
            made = [torch.ones(2), torch.randn(3), torch.arange(0.0, 1.0, 0.5), torch.ones(2, dtype=torch.int64) * 0.5]
            assert all(t.dtype == torch.float64 and inspect(t).dtype == torch.float64 for t in made)
            torch.set_default_dtype(torch.float32)
            b = torch.ones(2) * 0.5
            assert (a.dtype, b.dtype) == (torch.float32, torch.float32) and inspect(b).dtype == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_assigning_data_and_converting_a_module_change_the_workers_tensors(procs):
    """``t.data = new`` (which ``module.double()``, ``.bfloat16()`` and ``.to(dtype)`` use) changed only this
    side's metadata: the workers kept the old tensors, and the next op failed or ran on stale data."""
    torch.manual_seed(0)
    local = torch.nn.Linear(3, 2)
    want = local.double()(torch.ones(4, 3, dtype=torch.float64))
    here = torch.zeros(3)
    with procs.activate():
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2).double()
        assert m.weight.dtype == torch.float64 and inspect(m.weight).dtype == torch.float64
        out = m(torch.ones(4, 3, dtype=torch.float64))
        got = inspect(out)
        z = torch.ones(2)
        keep = z
        z.data = torch.arange(3.0)
        assert keep is z and z.shape == (3,) and inspect(z * 2).tolist() == [0.0, 2.0, 4.0]
        h = torch.nn.Linear(3, 4)
        opt = torch.optim.SGD(h.parameters(), lr=0.1)
        h.bfloat16()
        h(torch.ones(5, 3, dtype=torch.bfloat16)).sum().backward()
        opt.step()  # the optimizer holds the same parameter objects, now bfloat16 on the workers too
        assert inspect(h.weight).dtype == torch.bfloat16 and inspect(h.weight.grad).dtype == torch.bfloat16
        with pytest.raises(MeshTensorError, match="can only be another mesh tensor"):
            z.data = here
    assert torch.allclose(got, want.detach())


def test_deepcopy_of_a_model_on_the_mesh_copies_the_workers_values(procs):
    import copy

    with procs.activate():
        m = torch.nn.Linear(3, 2)
        m(torch.ones(1, 3)).sum().backward()
        c = copy.deepcopy(m)
        assert isinstance(c.weight, torch.nn.Parameter) and c.weight.requires_grad
        assert torch.equal(inspect(c.weight), inspect(m.weight)) and torch.equal(inspect(c.weight.grad),
                                                                                 inspect(m.weight.grad))
        with torch.no_grad():
            c.weight.add_(1.0)  # the copy's own value
        assert torch.equal(inspect(c.weight), inspect(m.weight) + 1)


def test_values_read_on_the_controller_are_clear_errors(procs):
    with procs.activate():
        a, b = torch.ones(2), torch.ones(2)
        with pytest.raises(MeshTensorError, match="allclose.*lives on the workers"):
            torch.allclose(a, b)
        with pytest.raises(MeshTensorError, match=r"torch.tensor\(\) of a list holding mesh tensors.*torch.stack"):
            torch.tensor([a[0], [b[1]]])
        assert inspect(torch.stack([a[0], b[1]])).tolist() == [1.0, 1.0]


def test_methods_that_reach_a_tensors_memory_are_clear_errors_not_crashes(procs):
    # The controller's tensor has no memory: torch's own apply_ and share_memory_ crashed the controller
    # (SIGSEGV), and DLPack exported a dangling pointer.
    import numpy as np

    with procs.activate():
        x = torch.arange(4.0)
        for what, call in [("apply_", lambda: x.apply_(lambda v: v * 2)),
                           ("map_", lambda: x.map_(x, lambda a, b: a + b)),
                           ("map2_", lambda: x.map2_(x, x, lambda a, b, c: a)),
                           ("share_memory_", lambda: x.share_memory_()),
                           ("is_shared", lambda: x.is_shared()),
                           ("untyped_storage", lambda: x.untyped_storage()),
                           ("storage", lambda: x.storage()),
                           ("numpy.asarray", lambda: np.asarray(x)),
                           ("DLPack", lambda: torch.from_dlpack(x))]:
            with pytest.raises(MeshTensorError, match=rf"{what}.*memory lives on the workers"):
                call()
        assert x.pin_memory() is x  # (on the workers' device already, as cuda() says)
        assert inspect(x).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_format_spec_formats_a_0_dim_tensors_item_as_torchs_does(procs):
    # torch.Tensor.__format__ formats item() only for torch.Tensor itself: f"{loss:.4f}" raised TypeError.
    with procs.activate():
        known = torch.tensor(1.23456) * 2  # a value the controller knows
        assert f"{known:.3f}" == "2.469" and f"{known}" == str(known)
        unknown = torch.ones(()) * procs.rank_tensor("gpus")
        with pytest.raises(MeshTensorError, match="fetch_shard"):
            f"{unknown:.3f}"
        assert f"{unknown}".startswith("MeshTensor(")


def test_an_op_returning_a_sparse_tensor_is_refused_at_the_line(procs):
    # The controller recorded a strided tensor where the workers held a sparse one: later ops failed there.
    with procs.activate():
        x = torch.tensor([0.0, 2.0, 0.0, 3.0])
        with pytest.raises(MeshTensorError, match="layout torch.sparse_coo: sparse .* not supported on mesh"):
            x.to_sparse()
        assert inspect(x + 1).tolist() == [1.0, 3.0, 1.0, 4.0]


def test_index_lists_that_do_not_broadcast_are_torchs_index_error_at_the_line(procs):
    # index_put_'s meta kernel does not check them: the workers' error came only at a fetch.
    with procs.activate():
        x = torch.zeros(2, 3, 4)
        for target in (x, x[:, :, 0]):  # (the second through a view: x[..., 0] = v)
            with pytest.raises(IndexError, match=r"could not be broadcast together with shapes \[2\], \[3\]"):
                target[[0, 0], [0, 0, 0]] = 5.0
        x[[0, 1], [2]] = 5.0  # ([2] and [1] broadcast)
        assert inspect(x.sum()).item() == 40.0


def test_metadata_and_local_constants(procs):
    with procs.activate():
        a = torch.arange(6.0).reshape(2, 3)
        assert a.shape == (2, 3) and a.dtype == torch.float32
        b = a.t() @ torch.tensor([[1.0], [2.0]])  # torch.tensor(list) inside activate is a mesh tensor
        assert b.shape == (3, 1)
        c = a + torch.ones(3)
        with no_mesh():
            plain = torch.ones(3)
        assert type(plain) is torch.Tensor
        d = a * plain  # a local tensor used by a mesh op travels as a constant
        got = inspect((b, c, d))
    local = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(got[0], local.t() @ torch.tensor([[1.0], [2.0]]))
    assert torch.equal(got[1], local + 1)
    assert torch.equal(got[2], local)


def test_shape_error_raises_at_once(procs):
    with procs.activate():
        a = torch.ones(2, 3)
        with pytest.raises(RuntimeError):
            a @ torch.ones(2, 3)
        with pytest.raises(MeshTensorError, match="ranks hold different values.*fetch_shard"):
            (a * procs.rank_tensor("gpus")).sum().item()  # a value per rank


def test_error_is_a_value_and_mesh_stays_usable(procs):
    from monarch_tensor.controller.api import remote

    def boom(x):
        raise ValueError("bad input on purpose")

    fail = remote(boom, propagate=lambda x: x)
    with procs.activate():
        x = torch.ones(3)
        y = fail(x)  # the line that must be reported
        z = (y + 1) * 2  # dependents propagate the error without running
        with pytest.raises(RemoteException) as info:
            fetch_shard(z).result(timeout=60)
        text = str(info.value)
        assert "bad input on purpose" in text
        assert "test_engine.py" in text and "y = fail(x)" in text
        assert info.value.rank == 0
        again = inspect(x * 3)
    assert torch.equal(again, torch.full((3,), 3.0))


def test_deletes_keep_worker_refs_flat(procs):
    with procs.activate():
        x = torch.zeros(8)
        for _ in range(50):
            x = x + 1
        inspect(x)
        gc.collect()
        before = worker_stats(procs)["refs"]
        for _ in range(2000):
            x = x * 1.0 + 1
        last = inspect(x)
        gc.collect()
        inspect(x)
        after = worker_stats(procs)["refs"]
    assert torch.equal(last, torch.full((8,), 2050.0))
    assert after <= before + 5, (before, after)


def _train(model, opt, x, y, steps):
    from torch import nn

    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            if type(p.grad) is not torch.Tensor:
                p.grad.reduce_("gpus", "avg")
        opt.step()
        losses.append(loss.detach())
    return losses


def _faults_reallocating(n_mib: int, rounds: int):
    """This proc's minor page faults while it allocates ``n_mib`` tensors of 1 MiB and frees them, ``rounds``
    times, after one round to warm up (on the worker's stream thread, like any op's outputs)."""
    def burst():
        ts = [torch.ones(1 << 18) for _ in range(n_mib)]
        del ts

    def minflt():
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])

    burst()
    before = minflt()
    for _ in range(rounds):
        burst()
    return torch.tensor(minflt() - before)


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat") or not _glibc(), reason="needs Linux with glibc")
def test_a_worker_keeps_freed_tensor_memory_for_its_next_allocations(procs):
    n_mib, rounds = 96, 3
    faults = remote(_faults_reallocating, propagate=lambda n, r: torch.tensor(0))
    with procs.activate():
        got = [int(inspect(faults(n_mib, rounds), gpus=g)) for g in range(2)]
    touched = n_mib * rounds * (1 << 20) // 4096
    assert all(f < touched // 10 for f in got), f"page faults {got} for {touched} pages reallocated"


@pytest.mark.parametrize("bad", ["a", 2**70])
def test_manual_seed_inside_activate_refuses_a_bad_seed_before_the_workers_see_it(procs, bad):
    with procs.activate():
        torch.manual_seed(5)
        with pytest.raises(ValueError, match=rf"torch.manual_seed\({bad!r}\) inside activate\(\): the seed must "
                                             r"be an int"):
            torch.manual_seed(bad)
        x = torch.rand(3)  # the workers kept seed 5, as this process did
        got = inspect(x, gpus=1)
        torch.manual_seed(5)
    with no_mesh():
        torch.manual_seed(5)
        want = torch.rand(3, device=WORKER_DEVICE).cpu()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("opt_name,foreach", [("SGD", True), ("AdamW", False)])
def test_training_matches_local(procs, opt_name, foreach):
    """nn.Module, autograd and torch.optim run unchanged; the result equals local training."""
    from torch import nn

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        kw = {"momentum": 0.9} if opt_name == "SGD" else {}
        opt = getattr(torch.optim, opt_name)(model.parameters(), lr=0.05, foreach=foreach, **kw)
        x = torch.randn(6, 8)
        y = torch.randint(0, 4, (6,))
        return model, opt, x, y

    with procs.activate():
        model, opt, x, y = make()
        assert all(type(p) is not torch.Tensor for p in model.parameters())
        mesh_losses = inspect(torch.stack(_train(model, opt, x, y, 4)), gpus=1)
        w = inspect(model[0].weight, gpus=0)
    with torch.device(WORKER_DEVICE):
        model, opt, x, y = make()
        local_losses = torch.stack(_train(model, opt, x, y, 4)).cpu()
    torch.testing.assert_close(mesh_losses, local_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w, model[0].weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert mesh_losses[-1] < mesh_losses[0]


_WARM_SCRIPT = """
import sys, time
import torch
from monarch_tensor import fetch_shard, this_host
import monarch_tensor.controller.tensor as ct
mesh = this_host().spawn_procs(per_host={"gpus": 1})
warm = ct._fake_mode is not None and "torch._dynamo" in sys.modules
with mesh.activate():
    t = time.perf_counter()
    x = torch.ones(3) * 2
    first = time.perf_counter() - t
    got = fetch_shard(x).result(timeout=60)
assert torch.equal(got, torch.full((3,), 2.0)), got
print("warm", warm, "first-op-s", round(first, 3))
mesh.stop().get(timeout=30)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("off", ["", "1"])
def test_the_first_spawn_builds_the_fake_tensor_mode_while_the_procs_start(off, tmp_path):
    """The fake mode imports torch._dynamo (seconds): spawning the first procs builds it meanwhile, so the
    script's first mesh op does not pay for it. ``MONARCH_TENSOR_NO_WARMUP=1`` turns that off."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MONARCH_TENSOR_NO_WARMUP=off, PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-c", _WARM_SCRIPT], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"warm {not off} " in p.stdout, p.stdout


_CONTROLLER_SCRIPT = """
import sys
import torch
import monarch_tensor
from monarch_tensor import fetch_shard, proc_mesh
mesh = proc_mesh(gpus=2)
with mesh.activate():
    x = (torch.ones(3) + mesh.rank("gpus")).reduce("gpus", "sum")
    got = fetch_shard(x, gpus=1).result(timeout=60)
assert torch.equal(got, torch.full((3,), 3.0)), got
print("worker modules", sorted(n for n in sys.modules if n.startswith("monarch_tensor.worker")))
mesh.stop().get(timeout=30)
"""


def test_the_controller_imports_none_of_the_workers_runtime(tmp_path):
    """A script that runs mesh ops (a collective among them) imports the worker's interface and instruction
    records, not its interpreter (``worker.worker``) or its collectives: the worker actor is spawned by its
    class's path (``worker/interface.py``), and only the procs import it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _CONTROLLER_SCRIPT], cwd=str(tmp_path), capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root), timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("worker modules "))
    loaded = set(eval(line[len("worker modules "):]))
    assert "monarch_tensor.worker.interface" in loaded, loaded  # (the check sees what the script imported)
    runtime = {f"monarch_tensor.worker.{m}" for m in ("worker", "collectives", "shm_reduce", "program", "stretch",
                                                      "dtensor", "fsdp", "checkpoint")}
    assert not loaded & runtime, sorted(loaded & runtime)


def _counted_batches(procs, monkeypatch):
    """Inside ``procs.activate()``: the mesh's client, the sizes of the batches it sends from now on (empty ones
    left out), and a mesh tensor ``x`` (zeros(4)); what was issued before, and the deletes of tensors dropped
    before, were sent already."""
    from monarch_tensor.controller.api import client_for

    client = client_for(procs)
    sent = []
    real_send = client._send
    monkeypatch.setattr(client, "_send", lambda batch, ranks: (batch and sent.append(len(batch)), real_send(batch, ranks)))
    x = torch.zeros(4)
    inspect(x)
    client.flush_deletes()
    sent.clear()
    return client, sent, x


def test_coalescing_sends_the_ops_of_its_block_as_one_batch(procs, monkeypatch):
    import monarch_tensor

    with procs.activate():
        client, sent, x = _counted_batches(procs, monkeypatch)
        with monarch_tensor.coalescing():
            for _ in range(100):  # outside, these would leave in batches of 16, 32, 64 ... (the size bound)
                x = x + 1
            time.sleep(0.3)  # a pause: outside, the idle flusher would send them now
            assert sent == []
        assert len(sent) == 1 and sent[0] >= 100
        assert inspect(x, gpus=1).tolist() == [100.0] * 4
        sent.clear()
        for _ in range(100):
            x = x + 1
        inspect(x)
    assert len(sent) > 2  # without coalescing(): several batches


def test_an_idle_flush_decided_before_a_coalescing_block_sends_none_of_its_ops(procs, monkeypatch):
    # The flusher saw the batch stop growing, then the script began a block and issued into it before the
    # flusher sent: the send must see the block (CI once sent 44 of a block's ops early so). The script's
    # thread holds the client's lock while the flusher's decision waits for it.
    import monarch_tensor

    with procs.activate():
        client, sent, x = _counted_batches(procs, monkeypatch)
        decided = []
        with client._lock:
            mark = client.seq + len(client._q)  # (its batch stopped growing at this mark)
            flusher = threading.Thread(target=lambda: decided.append(client.flush_if_idle(mark, {client})))
            flusher.start()
            time.sleep(0.05)  # (it waits for the lock)
            with monarch_tensor.coalescing():
                x = x + 1
                client._lock.release()
                try:
                    flusher.join(timeout=30)
                finally:
                    client._lock.acquire()
                assert decided == [None] and sent == []  # (None: the batch needs no more watching)
        assert len(sent) == 1  # at the block's end
        assert inspect(x, gpus=1).tolist() == [1.0] * 4


def _sent_within(sent: list, n: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while len(sent) < n and time.monotonic() < deadline:
        time.sleep(0.002)
    return len(sent) >= n


def test_a_batch_the_script_leaves_goes_out_whether_the_flusher_looks_or_waits(procs, monkeypatch):
    # The idle flusher looks every IDLE_S while batches keep coming and waits to be woken once none came for
    # PARK_S: a batch that begins in either state leaves without a fetch, alone (the script does nothing else).
    from monarch_tensor.controller import client as cc

    with procs.activate():
        client, sent, x = _counted_batches(procs, monkeypatch)
        x = x + 1  # (whatever the flusher's state: the first batch)
        assert _sent_within(sent, 1), "an idle batch was never sent"
        y = x + 1  # right after it: the flusher still looks on its own clock (unless 50 ms passed), nothing wakes it
        assert _sent_within(sent, 2), "a batch that began while the flusher looked was never sent"
        deadline = time.monotonic() + 10
        while not cc._flusher._parked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cc._flusher._parked, f"the flusher still looked {10} s after the last batch (PARK_S {cc.PARK_S})"
        z = y + 1  # the flusher waits: this batch's first instruction wakes it
        assert _sent_within(sent, 3), "a batch that began while the flusher waited was never sent"
        assert len(sent) == 3  # (one batch each: the first carries the delete of the x before it too)
        assert inspect(z, gpus=1).tolist() == [3.0] * 4


def test_flush_if_idle_sends_a_batch_only_after_a_look_saw_it_stop_growing(procs, monkeypatch):
    from monarch_tensor.controller import client as cc

    with procs.activate():
        client, sent, x = _counted_batches(procs, monkeypatch)
        monkeypatch.setattr(cc, "_flusher", types.SimpleNamespace(wake=lambda c: None))  # (the looks are this test's)
        pending = {client}
        x = x + 1
        first = client.flush_if_idle(None, pending)  # (a first look: it only notes where the batch is)
        assert first == client.seq + len(client._q) and sent == [] and pending == {client}
        x = x + 1  # it grew since that look: not sent, looked at again
        again = client.flush_if_idle(first, pending)
        assert again == first + 1 and sent == [] and pending == {client}
        assert client.flush_if_idle(again, pending) is None  # it did not grow: sent
        assert len(sent) == 1 and sent[0] >= 2 and pending == set()  # (the two ops, and the delete of the first x)
        pending.add(client)
        assert client.flush_if_idle(None, pending) is None and pending == set()  # nothing queued: not watched
        assert inspect(x, gpus=1).tolist() == [2.0] * 4


# ---- mesh tensors passed to actor endpoints ------------------------------------------------------------
class _Holder(Actor):
    def __init__(self) -> None:
        self.log = []

    @endpoint
    def describe(self, t, extra=None):
        parts = extra or {}
        return type(t).__name__, t.tolist(), {k: [v.tolist() for v in vs] for k, vs in parts.items()}

    @endpoint
    def record(self, tag, t=None):
        self.log.append((tag, None if t is None else t.tolist()))

    @endpoint
    def history(self):
        return self.log

    @endpoint
    async def scale_later(self, t, k):
        await asyncio.sleep(0.2)
        t.mul_(k)  # the rank's own tensor: ops issued after the call see this

    @endpoint(propagate=lambda t, k: t)
    def scaled(self, t, k):  # rref: a new tensor per rank, kept on the workers
        self.log.append(("scaled", k))
        return t * k + current_rank().rank

    @endpoint(propagate=lambda t: (t.sum(), torch.zeros(3, dtype=torch.int64)))
    async def two(self, t):
        await asyncio.sleep(0)
        return t.sum(), torch.arange(3) * current_rank().rank

    @endpoint(propagate=lambda t: t)
    def wrong_shape(self, t):
        return t[:1]

    @endpoint(propagate=lambda t: t)
    def fails(self, t):
        raise ValueError("rref endpoint fails on purpose")

    @endpoint
    def no_propagate(self, t):
        return t

    def plain_doubled(self, t):  # not an endpoint: as_endpoint(..., propagate=...).rref
        return t * 2


def _slow_plus(x, dt):
    time.sleep(dt)
    return x + 1


class _Box:
    def __init__(self, t) -> None:
        self.t = t


@pytest.fixture(scope="module")
def holder(procs):
    return procs.spawn("holder", _Holder)


def test_mesh_tensors_passed_to_an_actor_arrive_as_each_ranks_local_tensor(procs, holder):
    with procs.activate():
        x = torch.zeros(2) + procs.rank_tensor("gpus")
        got = holder.describe.call(x, extra={"twice": [x * 2, x + 10]}).get(timeout=60)
    assert [v for _, v in sorted(got.items(), key=lambda pv: pv[0].rank)] == [
        ("Tensor", [0.0, 0.0], {"twice": [[0.0, 0.0], [10.0, 10.0]]}),
        ("Tensor", [1.0, 1.0], {"twice": [[2.0, 2.0], [11.0, 11.0]]}),
    ]


def test_rref_keeps_an_endpoints_tensor_results_on_the_workers(procs, holder):
    with procs.activate():
        x = torch.ones(2) + procs.rank_tensor("gpus")
        y = holder.scaled.rref(x, 3.0)  # issued in order with the ops around it; no round trip
        z = y + 1
        s, r = holder.two.rref(z)
        got = [inspect(z, gpus=g) for g in range(2)]
        got_s, got_r = inspect(s, gpus=1), inspect(r, gpus=1)
        assert tuple(y.shape) == (2,) and s.shape == () and r.dtype == torch.int64
        with pytest.raises(RemoteException, match="its result 0 is a tensor of shape \\(1,\\).*propagate said"):
            inspect(holder.wrong_shape.rref(x) * 2, gpus=0)
        with pytest.raises(RemoteException, match="rref endpoint fails on purpose"):
            inspect(holder.fails.rref(x), gpus=1)
        with pytest.raises(MeshTensorError, match="propagate=fn"):
            holder.no_propagate.rref(x)
        with pytest.raises(MeshTensorError, match="not on exactly those procs"):
            holder.slice(gpus=0).scaled.rref(x, 2.0)
        doubled = as_endpoint(holder.plain_doubled, propagate=lambda t: t).rref(x)
        after = inspect(x + 0, gpus=0)  # the stream goes on after the failures
        got_doubled = inspect(doubled, gpus=1)
    assert [g.tolist() for g in got] == [[4.0, 4.0], [8.0, 8.0]]  # (1 + g) * 3 + g + 1
    assert got_s.item() == 16.0 and got_r.tolist() == [0, 1, 2]
    assert after.tolist() == [1.0, 1.0] and got_doubled.tolist() == [4.0, 4.0]
    assert ("scaled", 3.0) in holder.history.call().get(timeout=60).item(gpus=0)


def test_execute_gets_each_ranks_own_tensor(procs):
    with procs.activate():
        x = torch.ones(3) * (procs.rank_tensor("gpus") + 1)
        assert procs.execute(lambda t, k: float(t.sum()) * k, x, 10).values() == [30.0, 60.0]


def test_mesh_tensors_to_a_slice_of_the_actors_and_to_broadcast(procs, holder):
    with procs.activate():
        x = torch.zeros(1) + procs.rank_tensor("gpus")
        one = holder.slice(gpus=1).describe.call_one(x).get(timeout=60)  # only rank 1's proc is called
        holder.record.broadcast("broadcast", x * 3)  # no reply: it still runs in its place
        logs = holder.history.call().get(timeout=60)
    assert one == ("Tensor", [1.0], {})
    for point, log in logs.items():
        assert log[-1] == ("broadcast", [3.0 * point.rank])


def test_an_actor_call_with_mesh_tensors_keeps_its_place_among_ops_and_calls(procs, holder):
    slow = remote(_slow_plus, propagate=lambda x, dt: x)
    with procs.activate():
        x = torch.ones(1) * procs.rank_tensor("gpus")
        y = slow(x, 0.3)  # the stream is busy for 0.3 s when the calls below arrive
        first = holder.record.call("with tensor", y)
        second = holder.record.call("plain")  # no tensors: sent directly, yet it runs second
        first.get(timeout=60)
        second.get(timeout=60)
        z = torch.ones(1) * procs.rank_tensor("gpus")
        done = holder.scale_later.call(z, 5.0)
        w = z + 0  # issued after the call: runs after the (async) endpoint has returned
        done.get(timeout=60)
        after = inspect(w, gpus=1)
        logs = holder.history.call().get(timeout=60)
    for point, log in logs.items():
        assert log[-2:] == [("with tensor", [point.rank + 1.0]), ("plain", None)]
    assert after.tolist() == [5.0]


def test_an_actor_call_with_a_failed_or_misplaced_mesh_tensor_is_an_error(procs, holder):
    bad = remote(lambda x: x[100], propagate=lambda x: x)
    with procs.activate():
        x = torch.ones(3)
        with pytest.raises(RemoteException, match="IndexError|out of bounds"):
            holder.describe.call(bad(x)).get(timeout=60)
        assert holder.describe.call(x).get(timeout=60).item(gpus=0)[1] == [1.0, 1.0, 1.0]  # still serving
        one = procs.slice(gpus=0)
        with one.activate():
            only_rank0 = torch.ones(2)
        with pytest.raises(MeshTensorError, match="not on the procs of actor mesh 'holder'"):
            holder.describe.call(only_rank0)
        with pytest.raises(MeshTensorError, match=r"args\[0\]\.t is a mesh tensor inside a _Box object"):
            holder.describe.call(_Box(x))


def test_tensor_work_on_a_stopped_mesh_is_refused():
    from monarch_tensor.errors import MeshStoppedError

    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        with mesh.activate():
            x = torch.ones(3)
            assert fetch_shard(x).result(timeout=60).tolist() == [1.0, 1.0, 1.0]
    finally:
        mesh.stop().get(timeout=60)
    with pytest.raises(MeshStoppedError):
        x + 1
    with pytest.raises(MeshStoppedError):
        fetch_shard(x).result(timeout=60)
    with pytest.raises(MeshStoppedError):
        inspect(x)
    with pytest.raises(MeshStoppedError):
        with mesh.activate():
            pass
    with pytest.raises(MeshStoppedError):
        mesh.rank_tensor("gpus")
    del x  # its delete is queued, never sent


def test_bad_arguments_to_fetch_reduce_and_to_mesh_are_clear_errors(procs):
    with procs.activate():
        x = torch.ones(3)
        with pytest.raises(TypeError, match="shard must be a dict of coordinates .* not int 0"):
            fetch_shard(x, 0)
        with pytest.raises(TypeError, match="reduce's dims must be a dimension name .* not 5"):
            x.reduce(5)
        with pytest.raises(TypeError, match="reduce's dims .* not \\['gpus', 3\\]"):
            x.reduce(["gpus", 3])
        with pytest.raises(TypeError, match="to_mesh needs a proc mesh to copy to, .* not str 'x'"):
            x.to_mesh("x")
        assert fetch_shard(x, {"gpus": 1}).result(timeout=60).tolist() == [1.0, 1.0, 1.0]
        assert fetch_shard(x.reduce(["gpus"])).result(timeout=60).tolist() == [2.0, 2.0, 2.0]


def test_reduce_refuses_a_mesh_to_place_its_result_on(procs):
    # reduce(..., mesh=m) was accepted and ignored: the result stayed on the tensor's mesh (Monarch's refuses it)
    import monarch_tensor

    with procs.activate():
        x = torch.ones(3)
        for call in (lambda: x.reduce("gpus", "sum", mesh=procs.slice(gpus=0)),
                     lambda: monarch_tensor.reduce([x], "gpus", mesh=procs),
                     lambda: x.clone().reduce_("gpus", "sum", mesh="not a mesh"),
                     lambda: monarch_tensor.reduce_(x, "gpus", mesh=procs)):
            with pytest.raises(NotImplementedError, match=r"reduce_?\(mesh=...\) is not supported.*to_mesh"):
                call()
        assert inspect(x).tolist() == [1.0, 1.0, 1.0]


def test_a_to_mesh_send_on_a_stopping_proc_is_no_error_but_other_send_failures_are(caplog):
    # A script that ends with to_mesh transfers in flight: its procs close their mailboxes while a stream
    # still sends, and each such send printed a worker traceback ("handler handle_SendTensor failed ...
    # RuntimeError: mailbox is closed") after the script's own output. Nobody waits for those transfers.
    import logging
    from types import SimpleNamespace

    import monarch_tensor.worker.messages as wm
    from monarch_tensor.worker.worker import TensorWorker

    from monarch_tensor.transport.mailbox import Mailbox

    msg = wm.SendTensor(src=1, xfer=7, dests={0: "ipc://nowhere"}, stream=0, loc=None)
    mailbox = Mailbox()
    mailbox.close()
    stopping = SimpleNamespace(mailbox=mailbox, rank=0, _get=lambda ref: torch.ones(2))
    with caplog.at_level(logging.DEBUG, logger="monarch_tensor.worker"):
        TensorWorker.handle_SendTensor(stopping, msg)
    assert "to_mesh transfer 7 not sent: this proc is stopping" in caplog.text

    def send(addr, m):
        raise RuntimeError("a real failure")

    running = SimpleNamespace(mailbox=SimpleNamespace(closed=False, send=send), rank=0,
                              _get=lambda ref: torch.ones(2))
    with pytest.raises(RuntimeError, match="a real failure"):  # (the stream logs it with its traceback)
        TensorWorker.handle_SendTensor(running, msg)


def _inplace_metadata_programs():
    def transpose_():
        a = torch.arange(6.).reshape(2, 3)
        a.t_()
        return a.sum(1)

    def transpose_flatten():
        b = torch.arange(4.).reshape(2, 2)
        b.transpose_(0, 1)
        return b.flatten()

    def unsqueeze_():
        d = torch.arange(3.)
        d.unsqueeze_(1)
        return d + torch.ones(1, 4)

    def squeeze_matmul():
        h = torch.ones(1, 3)
        h.squeeze_(0)
        return h @ torch.arange(3.)

    def as_strided_():
        g = torch.arange(6.)
        g.as_strided_((2, 2), (1, 2))
        return g * 1

    def resize_():
        r = torch.arange(6.)
        r.resize_(2, 3)
        return r.sum(1)

    def set_():
        a = torch.zeros(3)
        a.set_(torch.arange(4.).reshape(2, 2))
        return a.sum(0)

    return [transpose_, transpose_flatten, unsqueeze_, squeeze_matmul, as_strided_, resize_, set_]


def _lazy_bit_programs():
    def view_as_real_of_resolved_conj():
        z = torch.complex(torch.arange(3.), torch.arange(3.) + 1)
        return torch.view_as_real(z.conj().resolve_conj())

    def arithmetic_on_a_conj_view():
        z = torch.complex(torch.arange(4.), torch.ones(4))
        c = z.conj()
        return torch.view_as_real((c * 2 + z) @ c.reshape(4, 1).expand(4, 2))

    def views_of_a_conj_view_keep_the_bit():
        z = torch.complex(torch.arange(6.), -torch.arange(6.)).reshape(2, 3)
        v = z.conj().t()[1:]
        assert v.is_conj()
        return torch.view_as_real(v.resolve_conj())

    def writing_through_a_conj_view():
        z = torch.complex(torch.arange(3.), torch.ones(3))
        c = z.conj()
        c.add_(torch.complex(torch.zeros(3), torch.ones(3)))  # z's imaginary part goes down by one
        c[0] = 5 + 5j
        return torch.view_as_real(z)

    def a_neg_view():
        n = torch.arange(4.)._neg_view()
        assert n.is_neg()
        return torch.stack([n.resolve_neg(), n + 1, n.clone()])

    return [view_as_real_of_resolved_conj, arithmetic_on_a_conj_view, views_of_a_conj_view_keep_the_bit,
            writing_through_a_conj_view, a_neg_view]


@pytest.mark.parametrize("program", _inplace_metadata_programs() + _lazy_bit_programs(), ids=lambda f: f.__name__)
def test_in_place_metadata_ops_and_conjugate_and_negative_views_behave_as_torchs(procs, program):
    # t_(), unsqueeze_(), resize_(), set_() ... changed the workers' tensor only: the controller kept the old
    # shape, so later ops were propagated (and checked) against it: wrong shapes, false errors, wrong values.
    # And the controller's tensors lacked torch's lazy conjugate / negative bits: z.conj().is_conj() was
    # False, so resolve_conj() was never sent and view_as_real failed on the workers.
    with no_mesh():
        want = program()
    with procs.activate():
        got = program()
        assert tuple(got.shape) == tuple(want.shape)
        assert torch.equal(inspect(got), want)


def test_a_set_tensor_forgets_its_known_value_when_its_new_memory_is_written(procs):
    with procs.activate():
        a, b = torch.zeros(2), torch.ones(2)
        a.set_(b)  # a now shares b's memory on the workers
        b.mul_(procs.rank_tensor("gpus") + 2)  # a value the controller cannot know
        assert _known(a.sum()) is None
        assert inspect(a.sum(), gpus=1).item() == 6.0


def _add_one_in_place(t):
    return t.add_(1)


def _known(t):
    """The value the controller knows for ``t`` (torch's own code reads it, as an optimizer its step counter),
    or None where only the workers know it."""
    return t._val.item() if hasattr(t, "_val") else None


def test_a_known_value_is_dropped_when_the_tensor_may_be_written_where_the_controller_cannot_follow(procs):
    # Small tensors made from constants carry their value on the controller (torch's code reads it with no
    # fetch). A write the controller cannot compute used to leave that value stale: it gave the old one.
    inc = remote(_add_one_in_place, propagate=lambda t: t)
    with procs.activate():
        x = torch.ones(())
        assert _known(x) == 1.0
        x.reduce_("gpus", "sum")
        assert _known(x) is None
        assert inspect(x).item() == 2.0
        base = torch.zeros(4)
        view = base[:2]
        view.add_(procs.rank_tensor("gpus") * 0 + 1)  # an unknown value, written through a view
        assert _known(base.sum()) is None
        assert inspect(base.sum()).item() == 2.0
        y = torch.zeros(3)
        inc(y)
        assert _known(y.sum()) is None
        assert inspect(y.sum()).item() == 3.0
        other = torch.zeros(4)
        part = other[:2]
        part.add_(1)  # a known value written through a view: the view knows it, its base no longer does
        assert _known(part.sum()) == 2.0
        assert _known(other.sum()) is None
        assert inspect(other).tolist() == [1.0, 1.0, 0.0, 0.0]
        step = torch.zeros(())
        step += 1  # optimizers' step counters keep their known values
        assert _known(step) == 1.0


def test_reading_a_mesh_tensors_value_fetches_it_however_it_was_made(procs):
    # One rule (issue 40): item(), float(), bool(), tolist(), numpy() and a formatted value read the value,
    # fetching it where the controller does not know it (a synchronisation), the same for a tensor made from
    # constants as for one computed on the workers. A mesh tensor holds a value per rank: where they differ,
    # the error shows them and the one-line fetch of one. A global (DTensor) tensor's value is its whole one.
    from monarch_tensor import distribute, preview

    with procs.activate():
        made_here, computed = torch.full((), 2.0), torch.ones(()) * 2 + procs.rank_tensor("gpus") * 0
        assert not hasattr(computed, "_val")
        for t in (made_here, computed):
            assert t.item() == 2.0 and float(t) == 2.0 and int(t) == 2 and bool(t) is True
            assert t.tolist() == 2.0 and t.numpy() == 2.0 and f"{t:.1f}" == "2.0"
        differs = torch.arange(3.0) + procs.rank_tensor("gpus")
        for read in (differs.sum().item, differs.tolist, differs.numpy, lambda: f"{differs.sum():.1f}"):
            with pytest.raises(MeshTensorError, match="ranks hold different values.*fetch_shard\\(t, gpus=0\\)"):
                read()
    got = preview(differs)
    n = len(procs._shape)
    assert [v.tolist() for v in got.values()] == [[float(r), r + 1.0, r + 2.0] for r in range(n)]
    assert "tensor([0., 1., 2.])" in repr(got)
    dt = distribute(torch.arange(4.0), procs, sharding_spec=["gpus"])
    assert dt.tolist() == [0.0, 1.0, 2.0, 3.0] and float(dt.sum()) == 6.0 and dt.numpy().tolist() == dt.tolist()
    assert preview(dt).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="takes a mesh tensor"):
        preview(torch.ones(2))


def _double(t):
    return t * 2


def _as_float(t):
    return float(t.sum())


def test_remote_checks_its_arguments_and_what_propagate_promised(procs):
    with pytest.raises(ValueError, match="needs a module and a name"):
        remote("foo")
    with pytest.raises(TypeError, match="needs a function or a dotted path"):
        remote(5)
    with pytest.raises(ValueError, match="propagate=...\\) must be"):
        remote(_double, propagate="bogus")
    pair = remote(_double, propagate=lambda t: (t, t))  # the function returns one tensor, not two
    with procs.activate():
        a, b = pair(torch.ones(3))
        with pytest.raises(RemoteException, match="returned 1 value\\(s\\) where its propagate said 2"):
            inspect(b)
    shape_lie = remote(_double, propagate=lambda t: t[:2])  # says 2 elements; the function returns 3
    dtype_lie = remote(_double, propagate=lambda t: t.to(torch.int64))
    not_tensor = remote(_as_float, propagate=lambda t: t.sum())
    with procs.activate():
        x = torch.ones(3)
        bad = [shape_lie(x), dtype_lie(x), not_tensor(x), shape_lie(x) + 1]
        good = remote(_double, propagate=lambda t: t)(x)
        for y, match in zip(bad, [r"result 0 is a tensor of shape \(3,\) and torch.float32, where its propagate said "
                                  r"a tensor of shape \(2,\) and torch.float32",
                                  r"shape \(3,\) and torch.float32, where its propagate said a tensor of shape "
                                  r"\(3,\) and torch.int64", "result 0 is a float, where its propagate said",
                                  "where its propagate said"]):
            with pytest.raises(RemoteException, match=match):
                inspect(y)
        assert inspect(good).tolist() == [2.0, 2.0, 2.0]


def test_code_written_for_gpus_runs_on_any_mesh(procs):
    """``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` name the workers' device: their GPU, or their CPU on a
    machine without one (and the controller needs no CUDA build of torch to record them)."""
    with procs.activate():
        x = torch.ones(4, 3, device="cuda") + procs.rank_tensor("gpus")
        w = torch.arange(6.0).reshape(2, 3).cuda()
        b = torch.zeros(2).to("cuda", torch.float64).to(device=torch.device("cuda", 0)).to(torch.float32)
        with torch.device("cuda"):
            b = b + torch.zeros(2) + torch.nn.Linear(2, 2).bias * 0
        y = (x @ w.T + b).reduce("gpus", "sum")
        got = fetch_shard(y, gpus=1).result(timeout=60)
    xs = [torch.ones(4, 3) + r for r in (0, 1)]
    assert got.device.type == "cpu"
    assert torch.equal(got, sum(x @ torch.arange(6.0).reshape(2, 3).T for x in xs))


def test_torch_device_context_still_places_factories_outside_activate(procs):
    """The factories' wrappers (installed by the first spawn) must not hide them from ``with torch.device(d):``."""
    with torch.device("meta"):
        made = [torch.zeros(2), torch.ones(2), torch.empty(3), torch.randn(2), torch.arange(3), torch.full((2,), 1.0)]
    assert [t.device.type for t in made] == ["meta"] * len(made)


def _slow_add_(x):
    time.sleep(0.3)
    x.add_(1)


slow_add_ = remote(_slow_add_, propagate=lambda x: None)


def test_a_fetch_of_a_ready_value_is_answered_at_once_and_never_before_the_work_issued_before_it(procs):
    """A fetch of a small value that nothing computes any more is answered on the proc's loop thread, without
    waking its stream's thread (``TensorWorker._fetch_here``); work issued before a fetch, still running or
    queued, is always waited for; a large value and a DTensor's shard take their stream's path; a failure
    raises as it always did."""
    from monarch_tensor import Shard, distribute

    ones, sixes, ones_big = torch.ones(3), torch.full((3,), 6.0), torch.ones(1 << 15)
    with procs.activate():
        x = torch.ones(3)
        assert torch.equal(fetch_shard(x, gpus=0).result(60), ones)  # (x is ready after this)
        here = worker_stats(procs)["fetched_here"]
        assert torch.equal(fetch_shard(x, gpus=0).result(60), ones)
        assert worker_stats(procs)["fetched_here"] == here + 1
        slow_add_(x)
        x.mul_(3)  # queued behind the sleeping function
        assert torch.equal(fetch_shard(x, gpus=0).result(60), sixes)
        assert torch.equal(fetch_shard(x * 1, gpus=1).result(60), sixes)
        big = torch.ones(1 << 15)  # 128 KiB: above FETCH_HERE_BYTES
        fetch_shard(big, gpus=0).result(60)
        here = worker_stats(procs)["fetched_here"]
        assert torch.equal(fetch_shard(big, gpus=0).result(60), ones_big)
        assert worker_stats(procs)["fetched_here"] == here
        dt = distribute(torch.arange(4.0), procs, {"gpus": Shard(0)})
        assert fetch_shard(dt, gpus=1).result(60).tolist() == [2.0, 3.0]
        here = worker_stats(procs, rank=1)["fetched_here"]
        assert fetch_shard(dt, gpus=1).result(60).tolist() == [2.0, 3.0]
        assert worker_stats(procs, rank=1)["fetched_here"] == here
        bad = torch.ones(3)[torch.tensor([5])]  # fails on the workers (index out of range)
        for _ in range(2):  # (the second: its failure stored, ready)
            with pytest.raises(RemoteException, match="index"):
                fetch_shard(bad, gpus=0).result(60)
        scalar = torch.tensor(2.5) * 2
        fetch_shard(scalar, gpus=0).result(60)
        assert fetch_shard(scalar, gpus=0).result(60).item() == 5.0


def test_a_failed_op_with_no_result_fails_the_next_fetch_instead_of_being_lost(procs):
    """``torch.linalg.cholesky`` checks its input in an op of its own that returns nothing: where that fails on
    the workers, no result holds the error, so the next fetch from that worker raises it (eager torch raises at
    the call); the fetch after it gets its value."""
    with procs.activate():
        factor = torch.linalg.cholesky(-torch.eye(2))  # not positive-definite
        y = factor * 2
        for r in (1, 0):  # each worker's own next fetch
            with pytest.raises(RemoteException, match=rf"_linalg_check_errors failed on rank {r}.*not positive-def"):
                fetch_shard(y, gpus=r).result(timeout=60)
        assert torch.equal(fetch_shard(y * 0, gpus=1).result(timeout=60), torch.zeros(2, 2))
        good = torch.linalg.cholesky(torch.eye(2) * 4)
        assert torch.equal(fetch_shard(good, gpus=1).result(timeout=60), torch.eye(2) * 2)


def test_a_no_result_op_on_a_failed_input_leaves_other_fetches_alone(procs):
    with procs.activate():
        bad = torch.ones(3)[torch.tensor([5])]  # fails on the workers (index out of range)
        factor = torch.linalg.cholesky(bad.reshape(1, 1))  # its check takes bad's failure: held by bad already
        other = torch.ones(2) * 3
        assert torch.equal(fetch_shard(other, gpus=0).result(timeout=60), torch.full((2,), 3.0))
        with pytest.raises(RemoteException, match="index"):
            fetch_shard(factor, gpus=0).result(timeout=60)


def test_a_failed_write_through_a_view_fails_the_tensors_that_share_its_memory(procs):
    # The failure was held by the view alone: its base and other views read as if nothing had happened.
    with procs.activate():
        x = torch.zeros(4)
        head = x[:1]
        x[1:].index_put_((torch.tensor([9]),), torch.tensor(1.0))  # index 9 is out of range: fails on the workers
        after = x + 1
        other = torch.ones(2)
        for t in (x, head, after):
            with pytest.raises(RemoteException, match="index 9 is out of bounds"):
                fetch_shard(t, gpus=1).result(timeout=60)
        assert inspect(other).tolist() == [1.0, 1.0]


def _overlapping_write(w, op: str, dst: slice, src: slice):
    if op == "copy_":
        w[dst].copy_(w[src])
    elif op == "add_":
        w[dst].add_(w[src])
    else:
        torch.mul(w[src], 2, out=w[dst])


@st.composite
def _two_slices(draw):
    """(n, dst, src): two slices of the same length (and step) of a tensor of n elements."""
    n = draw(st.integers(2, 9))
    step = draw(st.sampled_from([1, 1, 2]))
    k = draw(st.integers(1, (n - 1) // step + 1))
    extent = (k - 1) * step + 1
    a, b = draw(st.integers(0, n - extent)), draw(st.integers(0, n - extent))
    return n, slice(a, a + extent, step), slice(b, b + extent, step)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_two_slices(), op=st.sampled_from(["copy_", "add_", "out"]))
def test_a_write_that_partly_overlaps_another_argument_raises_at_the_line_as_in_torch(procs, case, op):
    # The workers refused it (torch's check), and the error came only at the next fetch of the tensor.
    n, dst, src = case
    w = torch.arange(float(n))
    try:
        _overlapping_write(w, op, dst, src)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    assert raised is None or "single memory location" in raised
    with procs.activate():
        mw = torch.arange(float(n))
        if raised is None:
            _overlapping_write(mw, op, dst, src)
        else:
            with pytest.raises(RuntimeError, match="single memory location"):
                _overlapping_write(mw, op, dst, src)
        assert torch.equal(inspect(mw), w)


def test_an_in_place_write_to_a_tensor_whose_elements_overlap_raises_at_the_line(procs):
    with procs.activate():
        z = torch.ones(3)
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            z.expand(2, 3).mul_(2)
        z.expand(2, 3).fill_(2.0)  # (which torch allows)
        assert inspect(z).tolist() == [2.0, 2.0, 2.0]


def test_a_random_fill_with_numbers_torch_refuses_raises_at_the_line_and_draws_nothing(procs):
    # The meta kernels the controller runs do not check these numbers: the workers' error came only at a fetch
    # (and `randn(out=)` of an integer tensor raised the meta kernel's RuntimeError, not torch's own).
    g = torch.Generator(WORKER_DEVICE).manual_seed(1)
    state, g_state = torch.get_rng_state(), g.get_state()
    with procs.activate():
        t = torch.zeros(3)
        fills = [(lambda: t.uniform_(2, 1), r"uniform_ expects to return a \[from, to\) range"),
                 (lambda: t.bernoulli_(1.5), r"bernoulli_ expects p to be in \[0, 1\]"),
                 (lambda: t.normal_(0, -1.0, generator=g), "normal expects std >= 0.0"),
                 (lambda: t.exponential_(-1.0), "exponential_ expects lambda > 0.0"),
                 (lambda: t.random_(5, 2), "random_ expects 'from' to be less than 'to'")]
        for fill, match in fills:
            with pytest.raises(RuntimeError, match=match):
                fill()
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            torch.randn(2, 3, out=torch.zeros(2, 3, dtype=torch.int64))
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(g.get_state(), g_state)
    with procs.activate():
        t.uniform_(0, 1)  # numbers torch takes: drawn on the workers
        got = inspect(t)
    assert ((got >= 0) & (got < 1)).all() and got.unique().numel() == 3


def test_an_error_at_the_line_has_torchs_own_exception_type(procs):
    # The meta kernels the controller runs raise other types for these (ValueError, RuntimeError), which an
    # `except` written for local torch missed.
    with procs.activate():
        x = torch.ones(3, 4)
        with pytest.raises(RuntimeError, match=r"Use \.reshape\(\.\.\.\) instead"):
            x.t().view(12)
        with pytest.raises(RuntimeError, match="At least one of 'min' or 'max' must not be None"):
            x.clamp()
        with pytest.raises(IndexError, match="could not be broadcast together"):
            x[[0, 0], [0, 0, 0]]
        with pytest.raises(IndexError, match="tensors used as indices must be long"):
            x[torch.ones(2)]
        with pytest.raises(IndexError, match="Expected reduction dim to be specified"):
            torch.empty(0).argmax()
        with pytest.raises(RuntimeError, match="cannot be multiplied"):  # (the same type already: unchanged)
            x @ x
        with pytest.raises(MeshTensorError, match="depends on the data"):  # the controller's own error stays
            x.nonzero()
        assert inspect(x.clamp(min=2.0)).tolist() == [[2.0] * 4] * 3
        # Inputs too large to run again on zeros: ones broadcast to their shapes give torch's message (the
        # meta kernel's is "a and b must have same reduction dim").
        big = torch.ones(1200, 1000)
        with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(1200x1000 and 3x5\)$"):
            big @ torch.ones(3, 5)
        with pytest.raises(IndexError, match="could not be broadcast together"):
            big[[0, 0], [0, 0, 0]]
        with pytest.raises(RuntimeError, match=r"view size is not compatible"):  # a view: the meta kernel's
            big.t().view(-1)                                                     # is a ValueError
        with pytest.raises(RuntimeError, match=r"^The size of tensor a \(1000\) must match"):  # in place
            big.add_(torch.ones(3, 5))


def _interrupt_when_waiting() -> threading.Thread:
    """Ctrl-C for the main thread once it waits on a Future (as a person's would come: not in the middle of
    the library's own bookkeeping)."""
    import _thread

    main = threading.main_thread().ident

    def run():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            f = sys._current_frames().get(main)
            while f is not None and not (f.f_code.co_name == "get" and f.f_code.co_filename.endswith("future.py")):
                f = f.f_back
            if f is not None:
                _thread.interrupt_main()
                return
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_interrupted_fetch_withdraws_the_mesh_work_no_rank_began(procs):
    """Ctrl-C while a fetch waits: the instructions sent that no rank began are dropped on every rank (a
    collective too: all of its ranks drop it or none does), what they would have made raises "withdrawn",
    what ran before keeps its value, and the mesh answers the next fetch without running the rest."""
    with procs.activate():
        x = torch.ones(300, 300)
        kept = x.sum()
        for _ in range(3000):  # far more work than the procs finish before the interrupt
            x = (x @ x / 300).reduce("gpus", "avg")
        waiter = _interrupt_when_waiting()
        with pytest.raises(KeyboardInterrupt):
            inspect(x)
        waiter.join()
        assert inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]
        assert inspect(kept).item() == 90000.0
        with pytest.raises(RemoteException, match="withdrawn: the script was interrupted"):
            inspect(x)
        y = torch.ones(3) * 2  # and the mesh computes on
        assert inspect(y.sum()).item() == 6.0


def _add_one(a, b=1):
    return a + b, current_rank().rank


add_one = remote(_add_one)


def test_a_remote_function_called_as_an_endpoint_runs_on_every_proc(procs):
    """Monarch's ``Remote`` is an endpoint: ``fn.call()`` inside ``activate()`` gives a ValueMesh of its plain
    results, ``send(fn, args, kwargs, port=port)`` sends each to a port."""
    from monarch_tensor.actor import Channel, send

    with procs.activate():
        assert add_one.call(2, b=5).get(timeout=60).values() == [(7, 0), (7, 1)]
        port, receiver = Channel.open()
        send(add_one, args=(10,), kwargs={}, port=port)
        assert sorted(receiver.recv().get(timeout=60) for _ in range(2)) == [(11, 0), (11, 1)]
        assert add_one.call_one.__doc__  # (call_one exists; it needs a mesh of one proc)
        assert procs.slice(gpus=1) is not None
    with procs.slice(gpus=1).activate():
        assert add_one.call_one(1).get(timeout=60) == (2, 0)  # current_rank(): its rank in the slice called
    with pytest.raises(MeshTensorError, match="inside `with mesh.activate\\(\\):`"):
        add_one.call()


def _as_dict(x):
    return {"twice": x * 2, "more": [x + 1, (x,)]}


as_dict = remote(_as_dict, propagate=lambda x: {"twice": x.clone(), "more": [x.clone(), (x.clone(),)]})


class Tripler(Actor):
    @endpoint(propagate=lambda t: t)
    def scaled(self, t):
        return t * 3


def test_remote_results_in_dicts_are_mesh_tensors_and_a_stopped_actors_rref_says_why(procs):
    """A remote function's dict result holds mesh tensors, as its lists and tuples do (they came back as the
    controller's fake tensors); a call through mesh tensors that reaches an actor after ``stop()`` fails
    with the stop's reason (it ran on the stopped actor and failed with "NoneType has no endpoint")."""
    with procs.activate():
        out = as_dict(torch.ones(3))
        assert inspect(out["twice"]).tolist() == [2.0] * 3 and inspect(out["more"][1][0]).tolist() == [1.0] * 3
        assert inspect(out["more"][0] + out["twice"]).tolist() == [4.0] * 3
    t = procs.spawn("tripler", Tripler)
    # Stopped through a copy (as another process holding the mesh would): t itself would refuse at the call.
    copy.copy(t).stop("no more tripling").get(timeout=60)
    with procs.activate():
        y = t.scaled.rref(torch.ones(2))
        with pytest.raises(RemoteException, match=r"was stopped \(no more tripling\)"):
            inspect(y)
        t.stop("stopped here").get(timeout=60)
        with pytest.raises(ActorError, match=r"was stopped \(stopped here\)"):
            t.scaled.rref(torch.ones(2))


def test_threads_of_the_script_use_one_mesh_at_once():
    # Each of these raced: two threads activating a fresh mesh spawned two tensor workers ("already runs"),
    # torch's FakeTensorMode (one per process) failed when two threads propagated shapes at once, and one
    # thread's fetch from one rank took the other thread's ops for all ranks with it: wrong sums, then hangs.
    import threading

    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    start = threading.Barrier(3)
    wrong, errors = [], []

    def work(t):
        try:
            start.wait(timeout=30)
            for i in range(8):
                with mesh.activate():
                    x = torch.ones(3, dtype=torch.float64) * (mesh.rank("gpus") + 1) * (t + 1) + i
                    y = x.reshape(1, 3).expand(2 + t, 3).sum(0)  # a shape per thread: propagation misses
                    got = fetch_shard(y.reduce("gpus", "sum"), gpus=i % 2).result(timeout=60)
                want = (2 + t) * (3.0 * (t + 1) + 2 * i)
                if got.tolist() != [want] * 3:
                    wrong.append((t, i, got.tolist(), want))
        except Exception as e:  # noqa: BLE001
            errors.append((t, repr(e)))

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=90)
        assert not any(th.is_alive() for th in threads), "a thread hung"
        assert errors == [] and wrong == []
    finally:
        mesh.stop().get(timeout=30)


def _tensors_of_numel(n):
    import gc

    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.numel() == n)


def test_dropped_tensors_are_freed_on_the_workers_while_the_script_is_idle(procs):
    # Their deletes waited for the script's next batch of ops: a script that went on with actors only, or
    # sat in a notebook, kept the workers' memory.
    n = 123457
    with procs.activate():
        x = torch.ones(n)
        s = x.sum()
    assert fetch_shard(s, gpus=0).result(timeout=60).item() == n  # (a fetch from one rank is the last batch)
    assert fetch_shard(s, gpus=1).result(timeout=60).item() == n  # (rank 1's streams ran the ops too: execute()
    # runs on the procs' own thread, not after their streams)
    assert procs.execute(_tensors_of_numel, n).values() == [1, 1]
    del x, s
    deadline = time.monotonic() + 30
    while (left := procs.execute(_tensors_of_numel, n).values()) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [0, 0]


def test_in_place_reduces_of_overlapping_memory_are_not_folded_into_one_collective(procs):
    # Adjacent reduces of a batch become one collective, which reads every input before it writes any: a
    # reduce_ of a view (or a detach()) of a tensor reduced just before lost its own reduction.
    from monarch_tensor.worker import messages as m

    from monarch_tensor import coalescing, reduce_

    def local(n, *parts):
        """Rank r's ``ones(n) * (r + 1)`` with each part (a slice) summed over the two ranks, one at a time."""
        ranks = [torch.ones(n) * (rank + 1) for rank in range(2)]
        for part in parts:
            total = ranks[0][part] + ranks[1][part]
            for t in ranks:
                t[part] = total
        return ranks[1].tolist()

    with procs.activate():
        r = procs.rank_tensor("gpus")
        with coalescing():  # (one batch, however the script is timed)
            b = torch.ones(4) * (r + 1)
            v = b[:2]
            b.reduce_("gpus", "sum")
            v.reduce_("gpus", "sum")
            d = torch.ones(3) * (r + 1)
            alias = d.detach()
            d.reduce_("gpus", "sum")
            alias.reduce_("gpus", "sum")
            flat = torch.ones(6) * (r + 1)
            pieces = [flat[:2], flat[2:]]
            flat.reduce_("gpus", "sum")
            for t in pieces:  # disjoint views of one buffer: still one collective for both
                t.reduce_("gpus", "sum")
            last = r._ctx.client._q[-1]
            assert type(last) is m.ReduceMany and last.srcs == tuple(t._ref for t in pieces)
            e = torch.ones(4) * (r + 1)
            reduce_([e, e[1:3]], "gpus", "sum")  # a pytree's leaves: as one at a time
        got = [inspect(t, gpus=1) for t in (b, d, flat, e)]

    every = slice(None)
    assert got[0].tolist() == local(4, every, slice(0, 2)) == [6, 6, 3, 3]
    assert got[1].tolist() == local(3, every, every) == [6, 6, 6]
    assert got[2].tolist() == local(6, every, slice(0, 2), slice(2, 6)) == [6] * 6
    assert got[3].tolist() == local(4, every, slice(1, 3)) == [3, 6, 6, 3]


def test_a_generator_given_to_random_ops_draws_what_it_draws_locally_and_moves_on(procs):
    # The generator went into each instruction as it was when the batch left: ops of two batches repeated
    # the same numbers, and the script's generator never moved on.
    from monarch_tensor import coalescing

    def draws(g, x):
        return [torch.randn(3, generator=g), torch.randint(0, 100, (4,), generator=g),
                torch.randperm(5, generator=g), x.clone().normal_(generator=g), torch.bernoulli(x / 2, generator=g)]

    ref = torch.Generator(WORKER_DEVICE).manual_seed(5)  # (on the GPU where the workers use one)
    with torch.device(WORKER_DEVICE):
        want = [t.cpu() for t in draws(ref, torch.ones(2)) + draws(ref, torch.ones(2))]
    g = torch.Generator(WORKER_DEVICE).manual_seed(5)
    with procs.activate():
        x = torch.ones(2) + procs.rank_tensor("gpus") * 0
        first = draws(g, x)
        got = [inspect(t, gpus=1) for t in first]  # (a fetch: the next draws are another batch)
        with coalescing():
            second = draws(g, x)
        got += [inspect(t, gpus=0) for t in second]
        assert torch.equal(g.get_state(), ref.get_state())
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch.device(WORKER_DEVICE):  # a local use goes on after
        assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))


def test_trunc_normal_init_runs_on_the_workers_and_draws_what_local_torch_draws(procs):
    # torch.nn.init.trunc_normal_ (GPT-2's, ViT's init) redraws by rejection in a loop on `mask.any()`, a read
    # of the data: on a mesh parameter it failed with "reading a mesh tensor's value on the controller".
    def init(seed, g):
        torch.manual_seed(seed)
        w, v = torch.nn.Linear(4, 4).weight, torch.empty(50, 3)
        torch.nn.init.trunc_normal_(w, std=0.02)  # most draws land in [a, b]: torch's redrawing branch
        torch.nn.init.trunc_normal_(v, std=0.5, a=-0.1, b=0.3, generator=g)  # a narrow [a, b]: its other branch
        return w, v

    ref = torch.Generator(WORKER_DEVICE).manual_seed(3)
    with torch.device(WORKER_DEVICE):
        want = [t.detach().cpu() for t in init(0, ref)]
    g = torch.Generator(WORKER_DEVICE).manual_seed(3)
    with procs.activate():
        w, v = init(0, g)
        got = [inspect(w, gpus=1), inspect(v, gpus=0)]
        assert torch.equal(g.get_state(), ref.get_state())  # the script's generator moved on as locally
        # control flow on the data reads it, fetched (the same on every rank here)
        assert bool((w > 0).any()) == bool((want[0] > 0).any())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_data_loader_iterates_inside_activate_as_in_plain_torch(procs):
    # torch.utils.data makes host-side tensors of its own (the iterator's seed, read with .item(); a
    # sampler's permutation; a collate's torch.tensor(numbers)): inside activate() they became mesh tensors
    # and iterating failed with a message about an .item() the script never called.
    from torch.utils import _pytree as pytree
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10))

    def batches(shuffle, seed=3):
        loader = DataLoader(ds, batch_size=4, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))
        return [(x, y) for x, y in loader] + [torch.utils.data.default_collate([1.5, 2.5])]

    want = batches(False) + batches(True)
    torch.manual_seed(7)
    want_global = [y for _, y in DataLoader(ds, batch_size=5, shuffle=True)]
    with procs.activate():
        got = batches(False) + batches(True)
        torch.manual_seed(7)
        got_global = [y for _, y in DataLoader(ds, batch_size=5, shuffle=True)]
        w = torch.ones(1) * 2
        scaled = inspect(got[0][0] * w, gpus=1)
    assert all(type(b) is not type(w) for b in pytree.tree_leaves(got + got_global))  # local, as in plain torch
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)))
    assert all(torch.equal(a, b) for a, b in zip(got_global, want_global))
    assert scaled.tolist() == [[0.0], [2.0], [4.0], [6.0]]


def test_a_shuffled_data_loader_and_random_ops_share_one_generator_as_locally(procs):
    # The loader drew its seeds from the controller's generator, which the random ops recorded for the workers
    # never moved, and its draws never moved the workers': a model built before it changed the shuffle from
    # the local one, and every random op after an epoch drew other numbers.
    from torch.utils.data import DataLoader, random_split

    def run():
        torch.manual_seed(0)
        with torch.device(WORKER_DEVICE):
            model = torch.nn.Linear(2, 1)  # random numbers drawn before the loader
        loader = DataLoader(list(range(10)), batch_size=5, shuffle=True)
        orders, draws = [], []
        for _ in range(2):
            orders.append([b.tolist() for b in loader])
            draws.append(torch.rand(3, device=WORKER_DEVICE))  # random numbers drawn after its epoch
        parts = [list(p) for p in random_split(range(6), [3, 3])]
        return orders, parts, draws + [torch.randn(2, device=WORKER_DEVICE), model.weight.detach()]

    want_orders, want_parts, want = run()
    with procs.activate():
        orders, parts, got = run()
        got = [inspect(t, gpus=1) for t in got]
    assert orders == want_orders and parts == want_parts
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.cpu())


def test_an_optimizer_loads_a_local_state_onto_the_mesh_and_trains_on_as_locally(procs):
    # torch moves each loaded state tensor with value.to(device=param.device), which kept it local for a mesh
    # parameter: the next step() wrote a mesh result into a local tensor and failed.
    from torch import nn

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))

    def train(m, opt, x, n):
        for _ in range(n):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()

    ref = model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    train(ref, ref_opt, x, 2)
    checkpoint = {"m": {k: v.clone() for k, v in ref.state_dict().items()},
                  "o": copy.deepcopy(ref_opt.state_dict())}
    train(ref, ref_opt, x, 2)
    with procs.activate():
        m = model()
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        m.load_state_dict(checkpoint["m"])
        opt.load_state_dict(checkpoint["o"])
        assert all(type(v) is type(m[0].weight) for s in opt.state.values() for v in s.values())
        train(m, opt, torch.tensor(x.tolist()), 2)
        got = [inspect(p, gpus=1) for p in m.parameters()]
        got_avg = inspect(opt.state[m[0].weight]["exp_avg_sq"], gpus=0)
    for p, want in zip(got, ref.parameters()):
        torch.testing.assert_close(p, want.detach())
    torch.testing.assert_close(got_avg, ref_opt.state[ref[0].weight]["exp_avg_sq"])


_COMPILE_SCRIPT = """
import torch
from monarch_tensor import inspect, this_host

@torch.compile  # (before the first activate(), as a decorator at the top of a script is)
def f(x):
    return torch.sin(x) * 2 + x.sum()

torch.manual_seed(0)
local = torch.nn.Linear(4, 2)
procs = this_host().spawn_procs(per_host={"gpus": 2})
with procs.activate():
    x = torch.arange(4.0) + procs.rank_tensor("gpus")
    y = f(x)
    torch.manual_seed(0)
    model = torch.compile(torch.nn.Linear(4, 2))
    model(x).sum().backward()
    got = inspect(y, gpus=1), inspect(model.weight.grad, gpus=1)
x = torch.arange(4.0) + 1
local(x).sum().backward()
assert torch.allclose(got[0], torch.sin(x) * 2 + x.sum()), got
assert torch.allclose(got[1], local.weight.grad), got
print("compiled ok")
procs.stop().get(timeout=30)
"""


@pytest.mark.timeout(300)  # (about 20 s of CPU: Dynamo compiles in the script and in both procs)
def test_torch_compile_of_a_function_of_mesh_tensors_runs_it_as_without_compile(tmp_path):
    # Dynamo compiled the engine's own frames (recording an op) too, graph-breaking at every other line,
    # and ended in a RecursionError after a minute. Now each op on a mesh tensor is a graph break.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=root),
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0 and "compiled ok" in p.stdout, p.stderr[-3000:]


def test_one_hot_without_num_classes_of_a_value_on_the_workers_says_its_shape_depends_on_the_data(procs):
    # It sizes its result by t.max().item() + 1 inside the op: the refusal named an .item() the script never
    # called, where other ops whose output shape depends on the data point to remote(..., propagate=...).
    from torch.nn import functional as F

    with procs.activate():
        idx = torch.tensor([0, 1]) + procs.rank_tensor("gpus")
        with pytest.raises(MeshTensorError, match=r"one_hot\(t\) without num_classes has an output shape that "
                                                  r"depends on the data .* propagate="):
            F.one_hot(idx)
        given = inspect(F.one_hot(idx, 4), gpus=1)
        known = F.one_hot(torch.tensor([0, 2]))  # (a value the controller knows: its shape is known too)
        got_known = inspect(known, gpus=0)
    assert torch.equal(given, F.one_hot(torch.tensor([1, 2]), 4))
    assert torch.equal(got_known, F.one_hot(torch.tensor([0, 2])))


def test_one_hot_of_a_class_value_out_of_range_is_torchs_error(procs):
    # Recorded as aten ops it gave a wrong result and no error (torch checks only tensors of its own type).
    from torch.nn import functional as F

    with procs.activate():
        with pytest.raises(RuntimeError, match="Class values must be smaller than num_classes"):
            F.one_hot(torch.tensor([0, 5]), 3)  # a value the controller knows: at the line
        idx = torch.tensor([0, 2]) + procs.rank_tensor("gpus")
        hot = F.one_hot(idx, 3)
        assert hot.shape == (2, 3) and hot.dtype == torch.int64
        assert torch.equal(fetch_shard(hot, gpus=0).result(timeout=60), F.one_hot(torch.tensor([0, 2]), 3))
        with pytest.raises(RemoteException, match="Class values must be smaller than num_classes"):
            fetch_shard(hot, gpus=1).result(timeout=60)  # (rank 1 holds the class value 3)
