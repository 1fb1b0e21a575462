"""The wire format and the protocol: every message round-trips and has a handler.

Unit tests of ``_wire.encode``/``decode`` and of ``Mailbox`` dispatch (no
procs), then fault injection on a live proc: garbage sent straight to its
ROUTER socket is dropped and the proc keeps serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import pickle
import sys
import threading
import time
import traceback
import types
import typing

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from monarch_tensor.actor import Actor, ActorError, Channel, endpoint, this_host
from monarch_tensor.errors import ProtocolError
from monarch_tensor.runtime._proc import ProcRuntime
from monarch_tensor.shape import Shape
from monarch_tensor.transport import _wire, messages
from monarch_tensor.transport.mailbox import Mailbox

pytestmark = pytest.mark.timeout(60)

# Records that messages carry but that are not messages themselves.
NOT_MESSAGES = {"PortRef"}

MESSAGES = sorted(
    (obj for name, obj in vars(messages).items()
     if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == messages.__name__),
    key=lambda c: c.__name__)
PROTOCOL = [m for m in MESSAGES if m.__name__ not in NOT_MESSAGES]


# ---- sample values per field type -------------------------------------------------------
class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _sample(tp, *, optional_none: bool = False):
    """A value of annotated type ``tp`` (resolved from ``typing.get_type_hints``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if optional_none and type(None) in args:
            return None
        return _sample(next(a for a in args if a is not type(None)))
    if tp is typing.Any:
        return {"nested": [1, 2.5, "three", None, (4, b"five")], "shape": Shape(("gpus",), (2,))}
    if tp is str:
        return "a-name"
    if tp is bool:
        return True
    if tp is bytes:
        return b"\x00pickled\xff"
    if tp is int:
        return 7
    if tp is tuple or origin is tuple:
        if args and args[-1] is Ellipsis:
            return tuple(_sample(args[0]) for _ in range(3))
        return (1, "two", 3.0)
    if tp is dict or origin is dict:
        return {"k": [1, 2], "j": None}
    if tp is BaseException:
        return ValueError("boom", 3)
    if inspect.isclass(tp) and dataclasses.is_dataclass(tp):
        return _instance(tp, optional_none=optional_none)
    raise AssertionError(f"test_wire has no sample for field type {tp!r}: add one to _sample()")


def _instance(cls, *, optional_none: bool = False):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], optional_none=optional_none) for f in dataclasses.fields(cls)})


def _same(a, b) -> bool:
    """Equality that also compares exceptions (by type and args) inside records."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    return a == b


def _roundtrip(msg):
    return _wire.decode(_wire.encode(msg))


# ---- every message ------------------------------------------------------------------------
def test_the_protocol_is_enumerated():
    names = {m.__name__ for m in PROTOCOL}
    assert {"SpawnActor", "CallEndpoint", "SendToPort", "StopProc"} <= names


@pytest.mark.parametrize("optional_none", [False, True], ids=["filled", "optionals-none"])
@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_every_message_round_trips(cls, optional_none):
    msg = _instance(cls, optional_none=optional_none)
    frames = _wire.encode(msg)
    assert len(frames) == PLAIN_FRAMES, "no buffers in these samples"
    out = _wire.decode(frames)
    assert _same(msg, out), (msg, out)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_every_message_is_a_frozen_slotted_record_with_a_docstring(cls):
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} should be frozen"
    assert "__slots__" in vars(cls), f"{cls.__name__} should use slots=True"
    assert (cls.__doc__ or "").strip() and not cls.__doc__.startswith(cls.__name__ + "("), \
        f"{cls.__name__} needs a one-line docstring saying who sends it and what it does"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(_instance(cls), dataclasses.fields(cls)[0].name, None)


def _dispatched_by_mailbox(cls) -> bool:
    """Feed a sample ``cls`` to a Mailbox: True when the mailbox consumes it itself
    (port values, logs) instead of handing it to the process's ``on_message`` hook."""
    passed_on, logs = [], []
    mb = Mailbox(on_message=passed_on.append, on_logs=logs.append, io_thread=False)
    try:
        class Sink:
            def __init__(self):
                self.got = []

            def deliver(self, msg):
                self.got.append(msg)
                return False

            def proc_died(self, addr, error):
                return False, False

        sink = Sink()
        ref = mb.open_port(sink)
        msg = _instance(cls)
        if "port_id" in {f.name for f in dataclasses.fields(cls)}:
            msg = dataclasses.replace(msg, port_id=ref.port_id)
        mb._dispatch(_wire.encode(msg))
        want = len(msg.values) if cls is messages.GatheredReplies else 1  # (one value a rank, to its port)
        assert len(passed_on) + len(logs) + len(sink.got) == want, f"{cls.__name__} went nowhere"
        return not passed_on
    finally:
        mb.close()


@pytest.mark.parametrize("cls", PROTOCOL, ids=lambda c: c.__name__)
def test_every_message_has_a_handler(cls):
    from monarch_tensor.transport.mailbox import SYSTEM_HANDLERS

    if cls in SYSTEM_HANDLERS:  # (handled in any process: a proc's fault, sent to whoever spawned its actor)
        return
    if _dispatched_by_mailbox(cls):
        return
    assert callable(getattr(ProcRuntime, f"handle_{cls.__name__}", None)), \
        f"procs receive {cls.__name__} but ProcRuntime has no handle_{cls.__name__}"


def test_mailbox_consumes_port_values_and_logs():
    assert _dispatched_by_mailbox(messages.SendToPort)
    assert _dispatched_by_mailbox(messages.ForwardLogs)


def test_every_handler_has_a_message():
    handlers = {n[len("handle_"):] for n, _ in inspect.getmembers(ProcRuntime) if n.startswith("handle_")}
    assert handlers <= {m.__name__ for m in PROTOCOL}, "a ProcRuntime handler for a message that no longer exists"


def test_mailbox_hands_other_messages_to_on_message_in_order():
    seen = []
    mb = Mailbox(on_message=seen.append, io_thread=False)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(mb.addr)
        sent = [messages.StopProc(f"reason {i}") for i in range(50)]
        for m in sent:
            s.send_multipart(_wire.encode(m))
        mb.wait_until(lambda: len(seen) == len(sent), timeout=10)
        assert seen == sent
    finally:
        s.close(linger=0)
        ctx.term()
        mb.close()


# ---- payloads ----------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5), children),
    max_leaves=20))
def test_any_builtin_value_round_trips(value):
    out = _roundtrip(messages.SendToPort(3, value, None, 1))
    assert out == messages.SendToPort(3, value, None, 1)


def _nbytes(frame) -> int:
    return len(frame) if isinstance(frame, (bytes, bytearray)) else memoryview(frame).nbytes


# Frames of a message that carries no buffer: everything after them is a buffer frame.
PLAIN_FRAMES = len(_wire.encode(messages.SendToPort(1, None, None, 0)))


def test_numpy_arrays_travel_out_of_band():
    arr = np.arange(1_000_000, dtype=np.float64).reshape(1000, 1000)
    small = arr[:10].copy()
    frames = _wire.encode(messages.SendToPort(1, {"a": arr, "b": small}, None, 0))
    assert len(frames) == PLAIN_FRAMES + 2, "each contiguous array is one buffer frame"
    assert sum(_nbytes(f) for f in frames[:PLAIN_FRAMES]) < 1024, "array bytes must not be pickled into the body"
    assert _wire.buffer_count(bytes(frames[0])) == 2
    bufs = [np.frombuffer(f, dtype=np.uint8) for f in frames[PLAIN_FRAMES:]]
    assert any(np.shares_memory(b, arr) for b in bufs), "the array is sent from its own memory, not a copy"
    out = _wire.decode(frames).value
    np.testing.assert_array_equal(out["a"], arr)
    np.testing.assert_array_equal(out["b"], small)
    assert out["a"].dtype == arr.dtype and out["a"].shape == arr.shape


@pytest.mark.parametrize("tensor", [
    torch.arange(1_000_000, dtype=torch.float32),
    torch.ones(500, 500, dtype=torch.bfloat16),
], ids=["float32", "bfloat16"])
def test_torch_tensors_travel_out_of_band(tensor):
    frames = _wire.encode(messages.SendToPort(1, tensor, None, 0))
    out = _wire.decode(frames).value
    assert torch.equal(out, tensor) and out.dtype == tensor.dtype
    assert len(frames) > PLAIN_FRAMES, "the tensor's bytes should be a buffer frame"
    assert sum(_nbytes(f) for f in frames[:PLAIN_FRAMES]) < 4096, "tensor bytes must not be pickled into the body"


def test_contiguous_tensors_with_odd_strides_on_size_one_dims_travel():
    # x[:, 0] of a batch of one: shape (1,), stride (4,), contiguous for torch; reshape(-1) keeps the stride
    for t in (torch.arange(4.).reshape(1, 4)[:, 0], torch.arange(24.).reshape(2, 3, 4)[:1, 1:2, :].transpose(0, 1)):
        assert t.is_contiguous()
        out = _wire.decode(_wire.encode(messages.SendToPort(1, t, None, 0))).value
        assert torch.equal(out, t) and out.shape == t.shape


def _shm_files() -> set[str]:
    import glob

    return set(glob.glob(f"/dev/shm/mt-{os.getpid()}-*"))


@pytest.mark.skipif(not hasattr(_wire, "MAGIC_SHM"), reason="no shared-memory path in this wire format")
def test_shared_memory_path_round_trips_and_leaves_no_file():
    from monarch_tensor.transport import _shm

    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    _shm._close_pool()  # earlier tests of this process may have pooled segments
    before = _shm_files()
    arr = np.arange(_shm.SHM_THRESHOLD // 8 + 10, dtype=np.float64)
    frames = _wire.encode(messages.SendToPort(1, arr, None, 0), shm=True)
    assert sum(_nbytes(f) for f in frames) < 4096, "the bytes are in shared memory, not in the frames"
    assert len(_shm_files() - before) == 1
    np.testing.assert_array_equal(_wire.decode(frames).value, arr)
    # the segment is pooled: once the receiver's view is freed, the next message reuses it
    frames = _wire.encode(messages.SendToPort(1, arr + 1, None, 0), shm=True)
    assert len(_shm_files() - before) == 1
    np.testing.assert_array_equal(_wire.decode(frames).value, arr + 1)
    _shm._close_pool()
    assert _shm_files() == before, "the sender's pool files are removed at exit"
    # below the threshold, nothing goes through shared memory
    small = _wire.encode(messages.SendToPort(1, np.arange(10), None, 0), shm=True)
    assert _shm_files() == before
    np.testing.assert_array_equal(_wire.decode(small).value, np.arange(10))



def test_running_out_of_descriptors_says_so_where_a_message_cannot_be_mapped(monkeypatch):
    # It read "cannot map the shared-memory buffers ... OSError(24, 'Too many open files')": a fault of the
    # shared memory, not of the receiving process's descriptor limit.
    import errno

    from monarch_tensor.transport import _shm

    if not _shm.available():
        pytest.skip("no writable /dev/shm")
    arr = np.arange(_shm.SHM_THRESHOLD // 8 + 10, dtype=np.float64)
    frames = _wire.encode(messages.SendToPort(1, arr, None, 0), shm=True)

    def out_of_descriptors(*args):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(_shm, "read", out_of_descriptors)
    with pytest.raises(_wire.PayloadLost, match=r"no file descriptor left .*ulimit -n") as info:
        _wire.decode(frames)
    assert isinstance(info.value.message, messages.SendToPort), "the message rebuilt, to fail its caller"
    monkeypatch.undo()
    _shm._close_pool()  # (the segment's flag stays set: no reader took the message)


def test_torch_tensors_round_trip():
    t = torch.randn(3, 4)
    out = _roundtrip(messages.SendToPort(1, {"t": t, "view": t[:, 1]}, None, 0)).value
    assert torch.equal(out["t"], t) and torch.equal(out["view"], t[:, 1])


def _at_misaligned_address(frame, off: int) -> memoryview:
    """A copy of ``frame`` whose bytes start ``off`` bytes past a 16-byte boundary (zmq keeps a small frame's
    bytes at any address)."""
    raw = bytearray(len(frame) + 32)
    shift = (off - np.frombuffer(raw, dtype=np.uint8).ctypes.data) % 16
    view = memoryview(raw)[shift:shift + len(frame)]
    view[:] = frame
    return view


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float64, torch.int32])
def test_tensors_whose_frame_is_misaligned_arrive_aligned(dtype):
    # A 3-element complex128 tensor arrived 12 bytes past a 16-byte boundary, and torch's kernels
    # on it crashed the receiver (SIGSEGV).
    t = torch.arange(300).to(dtype)  # (above INBAND_BYTES: a tensor of its own frame)
    frames = _wire.encode(messages.SendToPort(1, t, None, 0))
    assert len(frames) == 2, "the tensor's bytes should be a buffer frame"
    out = _wire.decode([frames[0], _at_misaligned_address(frames[1], 12)]).value
    assert out.data_ptr() % dtype.itemsize == 0
    assert torch.equal(out.clone(), t) and out.sum().item() == t.sum().item()


@pytest.mark.parametrize("t", [
    torch.tensor(2.5), torch.arange(6.0).reshape(2, 3), torch.arange(3).to(torch.complex128),
    torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False]), torch.ones(2, 0, 3),
    torch.arange(256, dtype=torch.int32), torch.arange(4.0).reshape(1, 4)[:, 0],
], ids=["scalar", "2d", "complex128", "bfloat16", "bool", "empty", "1KiB", "odd-strides"])
def test_small_tensors_travel_in_the_messages_body_as_writable_aligned_copies(t):
    """A tensor of up to INBAND_BYTES travels inside the body (one frame, which zmq copies), and arrives as a
    tensor of its own: aligned for its dtype, writable, not sharing memory with the frame."""
    assert t.numel() * t.element_size() <= _wire.INBAND_BYTES
    frames = _wire.encode(messages.SendToPort(1, t, None, 0))
    assert len(frames) == PLAIN_FRAMES and _wire.is_small(frames)
    out = _wire.decode(frames).value
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
    assert out.data_ptr() % t.element_size() == 0
    if out.numel():
        out.view(-1)[0] = out.view(-1)[-1]  # (writable; the frame's bytes stay as they were)
        assert torch.equal(_wire.decode(frames).value, t)
    big = torch.arange(257, dtype=torch.int32)  # one element more: out of band
    assert len(_wire.encode(messages.SendToPort(1, big, None, 0))) == PLAIN_FRAMES + 1


def test_lazy_conjugate_and_negative_views_travel_as_their_values():
    z = torch.randn(5, dtype=torch.complex64)
    x = torch.randn(6)
    out = _roundtrip(messages.SendToPort(1, {"conj": z.conj(), "neg": x._neg_view()}, None, 0)).value
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["neg"], -x)


@pytest.mark.parametrize("value", [torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
                                   torch.preserve_format, torch.strided, torch.sparse_coo])
def test_memory_formats_and_layouts_arrive_as_torch_own(value, monkeypatch):
    """A ``clone(memory_format=torch.contiguous_format)`` of a training step travels in a batch of ops (pickled by
    name, ``_wire._torch_attr``: pickle's own search for a memory format's module costs 100-200 µs), without
    cloudpickle's by-value path."""

    def refuse(*a, **k):
        raise AssertionError("pickled by value")

    monkeypatch.setattr(_wire, "_ByValuePickler", refuse)
    out = _roundtrip(messages.SendToPort(1, {"kw": value, "n": 3}, None, 0)).value
    assert out == {"kw": value, "n": 3} and out["kw"] is value


def test_code_defined_here_travels_by_value():
    class Local:
        def __init__(self, v):
            self.v = v

    fn = lambda x: x * 3  # pickle refuses lambdas; cloudpickle takes them
    out = _roundtrip(messages.SendToPort(1, (fn, Local(4)), None, 0)).value
    assert out[0](5) == 15 and out[1].v == 4


def test_code_sent_by_value_keeps_its_file_and_lines():
    """A proc's tracebacks and debugger show the script's file and lines for code sent by value (cloudpickle
    3.1.3 alone would name it ``<dynamic-code>``)."""

    def fail():
        raise ValueError("here")

    out = _roundtrip(messages.SendToPort(1, fail, None, 0)).value
    assert out is not fail and out.__code__ is not fail.__code__
    assert out.__code__.co_filename == __file__
    with pytest.raises(ValueError) as e:
        out()
    frame = traceback.extract_tb(e.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.line) == (__file__, fail.__code__.co_firstlineno + 1,
                                                          'raise ValueError("here")')


def test_importable_classes_travel_by_reference():
    frames = _wire.encode(messages.SpawnActor("e", Echo, (), {}, 0, Shape(("gpus",), (1,)), messages.PortRef("x", 1)))
    body = b"".join(bytes(f) for f in frames)
    assert Echo.__name__.encode() in body and len(body) < 1024
    assert _wire.decode(frames).cls is Echo


def test_decode_accepts_zmq_frames():
    arr = np.arange(100_000)
    frames = [zmq.Frame(bytes(f)) for f in _wire.encode(messages.SendToPort(1, arr, None, 0))]
    np.testing.assert_array_equal(_wire.decode(frames).value, arr)


# ---- malformed frames ---------------------------------------------------------------------------
class _RaisesOnLoad:
    def __reduce__(self):
        return (operator.truediv, (1, 0))


def _ghost_body() -> bytes:
    """A pickle naming a module that does not exist where it is loaded."""
    mod = types.ModuleType("_monarch_tensor_ghost")

    class Ghost:
        pass

    Ghost.__module__ = mod.__name__
    Ghost.__qualname__ = "Ghost"
    mod.Ghost = Ghost
    sys.modules[mod.__name__] = mod
    try:
        return pickle.dumps(Ghost(), protocol=5)
    finally:
        del sys.modules[mod.__name__]


def _message(body: bytes, nbuf: int = 0, magic: bytes = _wire.MAGIC, buffers: tuple = ()) -> list:
    """Frames in the current layout (header and body share the first frame) with any contents."""
    return [_wire._HEADER.pack(magic, nbuf) + body, *buffers]


GOOD = _wire.encode(messages.StopProc("x"))
GOOD_BODY = bytes(GOOD[0])[_wire._HEADER.size:]
TWO_BUFFERS = _wire.encode(messages.SendToPort(1, [np.arange(5), np.arange(7)], None, 0))
assert len(TWO_BUFFERS) == PLAIN_FRAMES + 2 and _message(GOOD_BODY) == [bytes(GOOD[0]), *GOOD[1:]]

MALFORMED = {
    "no frames": [],
    "short first frame": [os.urandom(3)],
    "empty first frame": [b""],
    "wrong magic": [b"XXXX" + bytes(GOOD[0])[4:], *GOOD[1:]],
    "too few buffers": [bytes(f) for f in TWO_BUFFERS[:-1]],
    "too many buffers": [*GOOD, b"extra"],
    "huge buffer count": _message(GOOD_BODY, nbuf=2**32 - 1),
    "random body": _message(os.urandom(64)),
    "empty body": _message(b""),
    "truncated body": _message(GOOD_BODY[:-3]),
    "body raises on load": _message(pickle.dumps(_RaisesOnLoad(), protocol=5)),
    "unknown module": _message(_ghost_body()),
}
if hasattr(_wire, "MAGIC_SHM"):
    MALFORMED.update({
        "shm: random descriptor": _message(GOOD_BODY, 1, _wire.MAGIC_SHM, (os.urandom(20),)),
        "shm: missing file": _message(GOOD_BODY, 1, _wire.MAGIC_SHM,
                                      (pickle.dumps(("mt-0-doesnotexist", [(0, 8)])),)),
        "shm: path outside /dev/shm": _message(GOOD_BODY, 1, _wire.MAGIC_SHM,
                                               (pickle.dumps(("../../etc/passwd", [(0, 8)])),)),
        "shm: no descriptor": _message(GOOD_BODY, 0, _wire.MAGIC_SHM),
    })


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frames_raise_protocol_error(name):
    with pytest.raises(ProtocolError):
        _wire.decode(MALFORMED[name])


def test_buffer_count_of_bad_headers_is_zero():
    assert _wire.buffer_count(b"") == 0
    assert _wire.buffer_count(b"MT") == 0
    assert _wire.buffer_count(_message(b"", 3, b"NOPE")[0]) == 0
    assert _wire.buffer_count(_message(b"body", 3)[0]) == 3
    assert _wire.buffer_count(bytes(TWO_BUFFERS[0])) == 2


def test_protocol_error_is_not_a_remote_error():
    assert not issubclass(ProtocolError, ActorError)


# ---- a live proc survives garbage ------------------------------------------------------------------
@pytest.fixture(scope="module")
def live():
    procs = this_host().spawn_procs({"gpus": 1})
    try:
        echo = procs.spawn("echo", Echo)
        echo.initialized.get(timeout=60)
        yield procs, echo, procs._procs[0].addr
    finally:
        procs.stop().get(timeout=30)


@dataclasses.dataclass(frozen=True)
class Bogus:
    """Not a message of the protocol."""

    x: int


GARBAGE = {
    **{k: v for k, v in MALFORMED.items() if v},  # zmq cannot send a message of zero frames
    "one random frame": [os.urandom(100)],
    "many random frames": [os.urandom(n) for n in (8, 50, 0, 1000, 3)],
    "unknown type (dict)": _wire.encode({"hello": 1}),
    "unknown type (int)": _wire.encode(12345),
    "unknown type (dataclass)": _wire.encode(Bogus(1)),
    "unknown type (by value)": _wire.encode(lambda: 1),
    "value for a port nobody opened": _wire.encode(messages.SendToPort(987654, 1, None, 0)),
    "call of an unknown actor, no reply": _wire.encode(messages.CallEndpoint("nobody", "x", (), {}, None)),
    "call with a reply that is not a port": _wire.encode(messages.CallEndpoint("echo", "echo", (1,), {}, "nowhere")),
    "call with args that are not a tuple": _wire.encode(messages.CallEndpoint("echo", "echo", 5, {}, None)),
    "spawn with nonsense fields": _wire.encode(messages.SpawnActor("z", 3, None, None, "r", None, None)),
    "batch: truncated": [_wire.pack_batch([bytes(GOOD[0]), bytes(GOOD[0])])[:-5]],
    "batch: lying count": [_wire._HEADER.pack(_wire.MAGIC_BATCH, 99) + os.urandom(40)],
    "batch: garbage inside": [_wire.pack_batch([os.urandom(30), b"", bytes(_wire.encode(12345)[0]),
                                                 _wire.pack_batch([os.urandom(9)])])],
    "compact tuple with missing fields": _wire.encode(("\0call", "echo")),
}


@contextlib.contextmanager
def _raw_socket(addr: str):
    """A plain zmq DEALER connected to a proc's address (as anything on the network could send from)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        yield sock
    finally:
        sock.close()
        ctx.term()


def _raw_call(sock: zmq.Socket, actor: str, method: str, *args):
    """Send a CallEndpoint on ``sock`` (after whatever it sent before) and wait for the reply."""
    port, receiver = Channel.open()
    sock.send_multipart(_wire.encode(messages.CallEndpoint(actor, method, args, {}, port._ref)))
    return receiver.recv().get(timeout=20)


def test_a_call_that_comes_before_its_actors_spawn_runs_once_the_actor_is_spawned(live):
    """A mesh handed to another actor right after its spawn may bring that actor's call to a proc before the
    spawner's SpawnActor (two senders: no order between them); the call waits for the spawn. A call to an
    actor that never comes fails, once it has waited (test_live_proc_answers_bad_calls_with_errors)."""
    procs, _, addr = live
    with _raw_socket(addr) as sock:
        port, receiver = Channel.open()
        sock.send_multipart(_wire.encode(messages.CallEndpoint("later", "echo", (7,), {}, port._ref)))
        time.sleep(0.3)  # (it has come, and found no actor of that name)
        procs.spawn("later", Echo).initialized.get(timeout=30)
        assert receiver.recv().get(timeout=20) == 7


@pytest.mark.parametrize("name", list(GARBAGE))
def test_live_proc_drops_garbage_and_keeps_serving(live, name):
    procs, echo, addr = live
    pid = echo.pid.call_one().get(timeout=20)
    with _raw_socket(addr) as sock:
        for _ in range(3):
            sock.send_multipart(GARBAGE[name])
        # Same socket, so the proc has handled the garbage before this call.
        assert _raw_call(sock, "echo", "echo", name) == name
    assert echo.echo.call_one([1, 2]).get(timeout=20) == [1, 2]
    assert echo.pid.call_one().get(timeout=20) == pid, "the same proc answers: it did not restart"
    assert procs._procs[0].alive


def test_live_proc_logs_what_it_dropped(live, capsys):
    import time

    procs, echo, addr = live
    with _raw_socket(addr) as sock:
        sock.send_multipart([b"ZQ9!" + bytes(GOOD[0])[4:], *GOOD[1:]])
        sock.send_multipart(GARBAGE["call with a reply that is not a port"])  # (run, it failed at its reply)
        assert _raw_call(sock, "echo", "echo", 1) == 1
    seen, deadline = "", time.monotonic() + 20
    while ("ZQ9!" not in seen or "not a PortRef" not in seen) and time.monotonic() < deadline:
        cap = capsys.readouterr()
        seen += cap.out + cap.err
        time.sleep(0.05)
    assert "malformed" in seen and "ZQ9!" in seen, "the proc's log of the dropped message reaches the client"
    assert "dropped a call of 'echo': its reply port is a str, not a PortRef" in seen, seen


def test_live_proc_answers_bad_calls_with_errors(live):
    procs, echo, addr = live
    with _raw_socket(addr) as sock:
        with pytest.raises(ActorError, match="no actor named 'nobody'"):
            _raw_call(sock, "nobody", "echo", 1)
        with pytest.raises(ActorError, match="no endpoint 'missing'"):
            _raw_call(sock, "echo", "missing")
        with pytest.raises(ActorError, match="no endpoint '__init__'"):
            _raw_call(sock, "echo", "__init__")
        assert _raw_call(sock, "echo", "echo", 5) == 5


def test_large_arrays_reach_a_live_proc_intact(live):
    _, echo, _ = live
    arr = np.random.default_rng(0).standard_normal((512, 1024))
    out = echo.echo.call_one({"arr": arr, "t": torch.arange(10)}).get(timeout=30)
    np.testing.assert_array_equal(out["arr"], arr)
    assert torch.equal(out["t"], torch.arange(10))


def test_garbage_from_many_threads(live):
    """Concurrent garbage from several sockets while calls go on."""
    procs, echo, addr = live
    stop = threading.Event()
    payloads = [v for v in GARBAGE.values()]

    def spam():
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        i = 0
        while not stop.is_set() and i < 500:
            s.send_multipart(payloads[i % len(payloads)])
            i += 1
        s.close()
        ctx.term()

    threads = [threading.Thread(target=spam) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(50):
            assert echo.echo.call_one(i).get(timeout=20) == i
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert echo.echo.call_one("still here").get(timeout=20) == "still here"


@pytest.mark.parametrize("reply", [None, messages.PortRef("ipc:///x", 7)], ids=["no-port", "port"])
def test_a_call_to_a_slice_travels_compact_with_its_shape(reply):
    """A call to a slice carries the slice's shape as plain tuples (a compact call) and arrives with an equal
    Shape, made once per distinct shape on the receiving side."""
    shape = Shape(("hosts", "gpus"), (2, 2), offset=1, strides=(4, 1))
    msg = messages.CallEndpoint("a", "m", (1,), {"k": 2}, reply, shape)
    assert messages._compact_call(msg)[0] == "\0call"
    first, second = _wire.decode(_wire.encode(msg)), _wire.decode(_wire.encode(msg))
    assert first == msg and first.shape == shape and first.shape.strides == (4, 1)
    assert first.shape is second.shape
    assert _wire.decode(_wire.encode(dataclasses.replace(msg, shape=None))).shape is None
