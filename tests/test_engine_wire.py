"""The tensor engine's instruction protocol: every instruction round-trips and has a handler.

Pure unit tests (no procs), plus the propagation cache and frame capture of the controller.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect as pyinspect
import types

import pytest
import torch
from monarch_tensor.worker import messages as m
from monarch_tensor.worker.errors import RemoteException
from monarch_tensor.worker.worker import TensorWorker, flat_leaves, resolve_function, resolve_op

from monarch_tensor.transport import _wire
from monarch_tensor.transport.messages import PortRef

pytestmark = pytest.mark.timeout(60)

SAMPLES = {
    m.CallOp: m.CallOp("aten::add.Tensor", (1, 2.5), {"alpha": 2}, (0,), (7,), (), 0, ("f.py", 3, "main")),
    m.CallFunction: m.CallFunction("torch.linalg.qr", (m.Ref(1),), {}, (2, 3), (), 1, None),
    m.CreateValue: m.CreateValue(4, torch.arange(6.0).reshape(2, 3), 0),
    m.CreateRank: m.CreateRank(5, {0: 0, 1: 1}, 0),
    m.DeleteRefs: m.DeleteRefs((1, 2, 3), 0),
    m.Reduce: m.Reduce(6, 5, ((0, 1), (2, 3)), "sum", False, True, 12, torch.float32, 0, ("f.py", 9, "g")),
    m.ReduceMany: m.ReduceMany((8, 9), (5, 6), ((0, 1),), "avg", False, (6, 4), torch.float32, 0, (None, None)),
    m.FetchValue: m.FetchValue({"a": m.Ref(3)}, None, PortRef("ipc:///tmp/x", 4), 0, None),
    m.SendTensor: m.SendTensor(3, 11, {0: "ipc:///tmp/a"}, 0, None),
    m.RecvTensor: m.RecvTensor(8, 11, 30.0, 0, None),
    m.CreateStream: m.CreateStream(2, "comms"),
    m.BorrowCreate: m.BorrowCreate(1, 3, 9, 0, 2),
    m.BorrowDrop: m.BorrowDrop(1, 9, 0, 2),
    m.ReportRefs: m.ReportRefs(PortRef("ipc:///tmp/x", 5), 0),
    m.CallActor: m.CallActor("trainer", "step", (m.Ref(3), 2), {"w": [m.Ref(4)]}, PortRef("ipc:///tmp/x", 6), 0,
                             ("f.py", 12, "main")),
    m.DefineProgram: m.DefineProgram(20, (m.CallOp("aten::add.Tensor", (-1, 1.0), {}, (0,), (-2,), (), 0, None),),
                                     (-1,), (-2,), ((),), 0),
    m.RunProgram: m.RunProgram(20, (3,), (21,), 0, ("f.py", 14, "main")),
}


def _is_record(obj) -> bool:
    """A frozen slotted dataclass, or a named tuple (``CallOp``, the one made per recorded op)."""
    if dataclasses.is_dataclass(obj):
        return obj.__dataclass_params__.frozen and hasattr(obj, "__slots__")
    return issubclass(obj, tuple) and hasattr(obj, "_fields") and obj.__slots__ == ()


def _fields(cls) -> tuple:
    return cls._fields if issubclass(cls, tuple) else tuple(f.name for f in dataclasses.fields(cls))


def test_every_instruction_has_a_sample_and_a_handler():
    records = {obj for obj in vars(m).values()
               if pyinspect.isclass(obj) and obj.__module__ == m.__name__ and _is_record(obj)}
    assert records == set(m.INSTRUCTIONS) == set(SAMPLES)
    for cls in m.INSTRUCTIONS:
        assert cls.__doc__ and len(cls.__doc__.strip()) > 10, cls
        assert callable(getattr(TensorWorker, f"handle_{cls.__name__}", None)), cls


def test_the_worker_implements_every_endpoint_of_its_interface_with_its_signature():
    """The controller calls the worker by ``worker/interface.py``'s class (it never imports ``TensorWorker``):
    the two declare the same endpoints, with the same parameters, and the path the procs import is the class."""
    from monarch_tensor.worker import interface
    from monarch_tensor.worker import worker as worker_module

    from monarch_tensor.runtime import _names

    def endpoints(cls) -> dict:
        return {n: pyinspect.signature(getattr(cls, n)) for n in dir(cls)
                if getattr(getattr(cls, n), "_is_endpoint", False)}

    declared = endpoints(interface.TensorWorkerInterface)
    assert {"execute", "pause", "withdraw", "peers_died"} <= set(declared)
    assert declared == endpoints(TensorWorker)
    assert _names.resolve(interface.IMPLEMENTATION) is TensorWorker
    assert interface.WORKER_NAME == worker_module.WORKER_NAME


@pytest.mark.parametrize("cls", m.INSTRUCTIONS, ids=lambda c: c.__name__)
def test_instruction_round_trips_through_the_wire(cls):
    msg = SAMPLES[cls]
    back = _wire.decode(_wire.encode([msg]))[0]
    assert type(back) is cls
    for name in _fields(cls):
        a, b = getattr(msg, name), getattr(back, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b, name


def test_remote_exception_pickles_and_names_the_line():
    e = RemoteException("aten::mm", (__file__, 1, "mod"), 3, "RuntimeError('x')", "Traceback...\nRuntimeError: x")
    back = _wire.decode(_wire.encode(e))
    assert isinstance(back, RemoteException) and back.rank == 3
    text = str(back)
    assert "aten::mm failed on rank 3" in text and f"{__file__}:1" in text and "Traceback" in text


def test_resolvers():
    assert resolve_op("aten::add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve_op("aten::mm") is torch.ops.aten.mm.default
    assert resolve_function("torch.linalg.qr") is torch.linalg.qr
    assert flat_leaves((1, [2, (3,)], torch.return_types.max((4, 5)))) == [1, 2, 3, 4, 5]


def test_shape_cache_hits_and_user_frame():
    from monarch_tensor.controller import tensor as ct
    from monarch_tensor.controller.client import user_loc

    def here():
        return user_loc()

    loc = (lambda: here())()
    assert loc[0] == __file__ and loc[2] == "<lambda>"
    fake = ct.to_fake
    with ct.fake_mode():
        t = fake(((2, 3), (3, 1), 0, torch.float32))
        assert t.shape == (2, 3)
        v = fake(((2,), (3,), 1, torch.float32))
        assert v.stride() == (3,) and v.storage_offset() == 1
    assert ct.contiguous_meta((2, 3, 4), torch.float16) == ((2, 3, 4), (12, 4, 1), 0, torch.float16)
    a, b = ((5,), (1,), 0, torch.int8), ((5,), (1,), 0, torch.int16)
    ids = ct.intern_meta(a), ct.intern_meta(b)
    assert ids[0] != ids[1]  # a meta's id names it alone
    assert (ct.intern_meta(((5,), (1,), 0, torch.int8)), ct.intern_meta(b)) == ids  # an equal meta: the same id


class _RacyQueue(collections.deque):
    """A batch queue whose first ``popleft`` lets "the script" issue an op and delete its constant,
    as the script thread can while the background flusher is taking a batch."""

    def __init__(self, client, late_op, late_ref) -> None:
        super().__init__()
        self.client, self.late = client, (late_op, late_ref)

    def popleft(self):
        item = super().popleft()
        if self.late is not None:
            op, ref = self.late
            self.late = None
            self.append(op)
            self.client.delete(ref, 0)
        return item


def _bare_client(monkeypatch, send):
    """A ``MeshClient`` of ranks (0, 1) with no procs behind it (no workers spawned, no mailbox):
    ``send(batch, ranks)`` gets what it sends, and no idle flusher runs (the tests flush)."""
    from monarch_tensor.controller import client as cc

    class NoIdleFlush:
        _clients: set = set()

        def wake(self, client) -> None:
            pass

    class ProclessClient(cc.MeshClient):
        def _connect(self, alloc) -> None:
            pass

        def _send(self, batch: list, ranks: tuple) -> None:
            send(batch, ranks)

    monkeypatch.setattr(cc, "_flusher", NoIdleFlush())
    procs = [types.SimpleNamespace(addr=f"ipc:///nowhere/proc-{r}", alive=True) for r in (0, 1)]
    return ProclessClient(types.SimpleNamespace(_procs=procs, _stopped=False))


def test_a_delete_never_overtakes_the_op_that_reads_its_ref(monkeypatch):
    sent: list = []
    client = _bare_client(monkeypatch, lambda batch, ranks: sent.append(list(batch)))
    upload = m.CreateValue(5, torch.ones(2), 0)
    reader = m.CallOp("aten::add.Tensor", (5, 1), {}, (0,), (6,), (), 0, None)
    client._q = _RacyQueue(client, reader, 5)
    client._q.append(upload)
    client.flush()
    client.flush()
    flat = [i for batch in sent for i in batch]
    deletes = [i for i, x in enumerate(flat) if isinstance(x, m.DeleteRefs) and 5 in x.refs]
    assert flat.index(upload) < flat.index(reader) < deletes[0], flat
    assert len(deletes) == 1


def test_an_instruction_a_finalizer_queues_goes_between_what_was_issued_before_and_after(monkeypatch):
    """``issue_later`` (a Borrow collected before its drop) takes no lock, and its instruction keeps its place:
    after what was issued before it, before what is issued after, for its own ranks."""
    sent: list = []
    client = _bare_client(monkeypatch, lambda batch, ranks: sent.extend((i, ranks) for i in batch))
    before, after = (m.CallOp("aten::add.Tensor", (1, 1), {}, (0,), (r,), (), 0, None) for r in (2, 3))
    drop = m.BorrowDrop(1, 4, 0, 1)
    client.issue(before, client.all_ranks)
    client.issue_later(drop, (1,))
    client.issue(after, client.all_ranks)
    client.flush()
    assert sent == [(before, (0, 1)), (drop, (1,)), (after, (0, 1))]


def test_batches_start_small_after_a_pause_and_double_during_a_burst(monkeypatch):
    """After a fetch or a pause the workers are idle: the next burst's first instructions leave at once
    (``FIRST_BATCH`` of them), and each batch sent for its size doubles the bound, up to ``MAX_BATCH``."""
    from monarch_tensor.controller import client as cc

    monkeypatch.setattr(cc, "FIRST_BATCH", 16)
    monkeypatch.setattr(cc, "MAX_BATCH", 128)
    sent: list = []
    client = _bare_client(monkeypatch, lambda batch, ranks: sent.append(len(batch)))

    def burst(n):
        for i in range(n):
            client.issue(m.CallOp("aten::add.Tensor", (1, 1), {}, (0,), (i + 2,), (), 0, None), client.all_ranks)

    burst(500)
    assert sent == [16, 32, 64, 128, 128, 128]  # 4 instructions still wait for the next flush
    client.flush()  # a fetch
    assert sent[-1] == 4
    del sent[:]
    burst(100)
    assert sent == [16, 32]  # started small again; 52 wait
    client.flush()
    burst(20)
    assert sent == [16, 32, 52, 16]


_RULES_SCRIPT = """
import sys, torch
from monarch_tensor.controller import torch_patches  # (the engine's import installs its lookup)
from torch._library import simple_registry

class Sub(torch.Tensor):
    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.full((2,), 1.0)

def rule(cls, func, types, args, kwargs):
    return torch.full((2,), 2.0)

calls = []
sys.setprofile(lambda frame, event, arg: event == "call" and calls.append(
    (frame.f_code.co_name, frame.f_code.co_filename)))
s = Sub((2,))
assert torch.abs(s).tolist() == [1.0, 1.0]  # no rule: the subclass's __torch_dispatch__
torch.library.register_torch_dispatch("aten::neg", Sub, rule)
assert torch.neg(s).tolist() == [2.0, 2.0]  # the rule registered for it
assert torch.abs(s).tolist() == [1.0, 1.0]
sys.setprofile(None)
lookups = [file for name, file in calls if name == "find_torch_dispatch_rule" and file == torch_patches.__file__]
assert len(lookups) == 3, calls  # (one per dispatch; on an op's first, it asks torch's own)
print("ok")
"""


def test_torch_finds_registered_dispatch_rules_through_the_engines_lookup():
    """The engine replaces torch's ``find_torch_dispatch_rule`` (asked before every ``__torch_dispatch__``) with a
    cheaper one: torch uses it (in a fresh process, where the engine's import came before any dispatch), and a
    rule registered with ``torch.library.register_torch_dispatch`` is found, before or after its first use."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RULES_SCRIPT], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_new_mesh_tensor_has_its_metadata_whether_torch_or_the_controller_gives_its_strides():
    """``new_tensor`` leaves the strides and offset of contiguous metadata to torch: they are the ones the
    controller's metadata says, for empty and size-1 dims too; any other metadata is given whole."""
    from monarch_tensor.controller import tensor as ct

    metas = [ct.contiguous_meta(shape, dtype) for shape in [(), (1,), (2, 3), (0, 3), (3, 0, 2), (4, 1, 1), (1, 5)]
             for dtype in (torch.float32, torch.int64)]
    metas += [((2, 3), (1, 2), 0, torch.float32), ((3,), (1,), 2, torch.float16), ((2, 2), (0, 1), 0, torch.float32),
              ((1, 4), (1, 1), 0, torch.float32)]
    for meta in metas:
        mid = ct.intern_meta(meta)
        assert (mid in ct._dense_mids) == (meta == ct.contiguous_meta(meta[0], meta[3])), meta
        t = ct.new_tensor(meta, mid, None, 0)
        assert (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) == meta
