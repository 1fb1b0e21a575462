"""The wire format: a header frame holding the pickle-5 body, then raw buffer frames.

``encode(msg)`` returns a list of frames for ``socket.send_multipart``: the
first is an 8-byte header (a magic tag and the number of buffers) followed by
the body (``msg`` pickled with protocol 5, out-of-band buffers left out); then
each out-of-band buffer (tensor or ndarray bytes) is its own frame, sent
without copying and never copied into the body. Header and body share a frame
because every extra frame costs a send call: a small message is one frame.
Plain pickle does the pickling; a message that refers to ``__main__`` (classes
and functions of a script or notebook) or holds something pickle refuses (a
lambda, a local class) is pickled again with cloudpickle so that code travels
by value. Everything importable travels by reference.

Large buffers take other paths (the header's magic says which): to
receivers on this host, one shared-memory segment (``_shm.py``); to
receivers on other hosts, one data-plane buffer that each receiver pulls
while decoding (``rdma/payload.py``).
"""

from __future__ import annotations

import contextlib
import copyreg
import errno
import io
import itertools
import logging
import pickle
import struct
import sys
import threading
import types
from collections import ChainMap
from typing import Any, Callable, ClassVar

import cloudpickle

from ..errors import ProtocolError
from . import _shm

log = logging.getLogger("monarch_tensor.wire")

MAGIC = b"MT01"
MAGIC_SHM = b"MT02"  # one extra frame: (name, layout) of a shared-memory file holding the buffers
MAGIC_DP = b"MT03"  # one extra frame: a data-plane Payload to pull the buffers from (rdma/payload.py)
MAGIC_BATCH = b"MT04"  # several small one-frame messages in one frame: header (count), then length-prefixed
_MAGICS = (MAGIC, MAGIC_SHM, MAGIC_DP)
_HEADER = struct.Struct("!4sI")
_LEN = struct.Struct("!I")
_MAIN = b"__main__"
# Addresses of mailboxes that decode in this very process (a script and its in-process actor runtime): what
# goes to one of them alone refers to ``__main__`` by reference, so that its classes and globals stay the
# script's own (a by-value class would be a copy, and a module-level list the actor appends to another list).
IN_PROCESS: set[str] = set()


class Unreadable(ProtocolError):
    """A message arrived whole but could not be read; ``message`` is its envelope, rebuilt as far as it
    can be (None if not even that), so that whoever waits on it can be told ``error``."""

    def __init__(self, error: BaseException, message: object) -> None:
        super().__init__(str(error))
        self.error, self.message = error, message


class PayloadLost(Unreadable):
    """A message's buffers could not be pulled from its sender, or mapped from shared memory; ``message`` is
    the message rebuilt over zeroed buffers."""


def encode(msg: object, shm: bool | int | list[str] = False, remote: tuple[int, str, str] | None = None) -> list:
    """Frames for ``msg``: header and body, then out-of-band buffers.

    With ``shm`` (the receivers, all on this host: their addresses, which lets
    ``_shm.release_reader`` free what one that dies held, or their number;
    ``True`` is one), large buffers go through shared memory; :func:`frames_for_reader` gives
    each receiver its frames. With ``remote`` = (receivers, the address of
    one of them, the sender's own address), for receivers on other hosts,
    large buffers are pulled by each receiver over the data plane.
    """
    if remote:
        with towards(remote[1]):
            return _encode(msg, shm, remote)
    return _encode(msg, shm, remote)


# The hottest messages (calls and replies) travel as plain tuples whose first item is a tag string:
# pickling a class by reference and calling its reducer costs several times more than the whole tuple.
# messages.py registers them: type -> (tuple from message), tag -> (message from tuple).
COMPACT_ENCODERS: dict[type, Callable[[object], tuple]] = {}
COMPACT_DECODERS: dict[str, Callable[[tuple], object]] = {}


def _encode(msg: object, shm: bool | int | list[str], remote: tuple[int, str, str] | None) -> list:
    buffers: list[pickle.PickleBuffer] = []
    compact = COMPACT_ENCODERS.get(type(msg))
    if compact is not None:
        msg = compact(msg)
    pickled = False
    try:
        if "torch" in sys.modules and not (compact is not None and _plain(msg, 3)):
            f = io.BytesIO()
            _torch_pickler()(f, protocol=5, buffer_callback=buffers.append).dump(msg)
            body = f.getvalue()
        else:
            body = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
        pickled = True
        by_value = _MAIN in body
    except (pickle.PicklingError, AttributeError, TypeError):
        by_value = True
    if by_value and pickled and IN_PROCESS and isinstance(shm, list) and len(shm) == 1 and shm[0] in IN_PROCESS:
        by_value = False
    if by_value:
        buffers.clear()
        f = io.BytesIO()
        _ByValuePickler(f, protocol=5, buffer_callback=buffers.append).dump(msg)
        body = f.getvalue()
    raws = [b.raw() for b in buffers]
    if shm and raws and sum(r.nbytes for r in raws) >= _shm.SHM_THRESHOLD and _shm.available():
        holders = shm if isinstance(shm, list) else None
        readers = len(shm) if isinstance(shm, list) else int(shm)
        desc = pickle.dumps(_shm.write(raws, readers=readers, holders=holders))
        return [_HEADER.pack(MAGIC_SHM, 1) + body, desc]
    if remote and raws and _payload().wanted(raws):
        try:
            payload = _payload().publish(raws, remote[0], remote[2])
        except Exception as e:  # noqa: BLE001 - the frames still carry them
            log.warning("cannot publish a message payload on the data plane (%r); it goes in the frames", e)
            payload = None
        if payload is not None:
            return [_HEADER.pack(MAGIC_DP, 1) + body, pickle.dumps(payload, protocol=5)]
    return [_HEADER.pack(MAGIC, len(raws)) + body, *raws]


def _code_reduce(code: types.CodeType):
    """cloudpickle's reducer of a code object, keeping the code's file name.

    cloudpickle 3.1.3 writes ``<dynamic-code>`` in place of it (for payloads that do not depend on where
    the code was defined); then tracebacks and the debugger on a proc could not show the script's file
    and lines for an actor class defined in ``__main__``."""
    rebuild, args = _CLOUD_CODE_REDUCE(code)
    return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


_CLOUD_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


class _ByValuePickler(cloudpickle.Pickler):
    """cloudpickle's Pickler (code travels by value), with code objects that keep their file names."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


# Values that pickle the same with and without the tensor reducer (a call's or reply's usual payload).
_PLAIN_TYPES = frozenset({int, float, str, bytes, bool, type(None)})


def _plain(x, depth: int) -> bool:
    """Whether ``x`` is built of plain values only (tuples, lists and dicts up to ``depth`` deep)."""
    t = type(x)
    if t in _PLAIN_TYPES:
        return True
    if not depth:
        return False
    if t is tuple or t is list:
        for y in x:
            if type(y) not in _PLAIN_TYPES and not _plain(y, depth - 1):
                return False
        return True
    if t is dict:
        for k, v in x.items():
            if type(k) not in _PLAIN_TYPES or (type(v) not in _PLAIN_TYPES and not _plain(v, depth - 1)):
                return False
        return True
    return False


_local = threading.local()


@contextlib.contextmanager
def towards(addr: str):
    """Within it, what is pickled goes to ``addr`` on another host (``RDMABuffer`` handles then name
    this machine's address on the route there)."""
    old = getattr(_local, "dest", None)
    _local.dest = addr
    try:
        yield
    finally:
        _local.dest = old


def destination() -> str | None:
    """The other host's address a message being encoded on this thread goes to (None: this host)."""
    return getattr(_local, "dest", None)


def _payload():
    from .. import _seams

    return _seams.get("payload")


def frames_for_reader(frames: list, i: int) -> list:
    """The frames receiver ``i`` of ``encode(msg, shm=n)`` gets (its own hold flag on shared memory)."""
    if len(frames) != 2 or bytes(frames[0][:4]) != MAGIC_SHM or i == 0:
        return frames
    return [frames[0], pickle.dumps(_shm.for_reader(pickle.loads(frames[1]), i))]


def encode_for(msg: object, addrs: list[str], mailbox=None) -> list[list]:
    """Frames for each of ``addrs`` (encoded once): large buffers through shared memory when every
    receiver is on this host, else over the data plane (given the sending ``mailbox``)."""
    if len(addrs) == 1 and mailbox is not None:  # the common case, without the lists
        target = mailbox.route_of(addrs[0])
        if target.startswith("ipc://"):
            return [encode(msg, shm=[target])]
        return [encode(msg, remote=(1, target, mailbox.public_addr))]
    targets = []
    for a in addrs:
        t = mailbox.route_of(a) if mailbox is not None else a
        if not t.startswith("ipc://"):  # (one is enough: the rest need not be resolved)
            remote = None if mailbox is None else (len(addrs), t, mailbox.public_addr)
            return [encode(msg, remote=remote)] * len(addrs)
        targets.append(t)
    frames = encode(msg, shm=targets if len(targets) <= _shm.MAX_READERS else False)
    return [frames_for_reader(frames, i) for i in range(len(addrs))]


_pickler: type | None = None


def _torch_pickler() -> type:
    """A Pickler whose dispatch table is copyreg's plus a reducer that sends CPU tensors' bytes out of
    band (torch's own pickling ignores protocol 5 and copies tensor bytes into the body), and a reducer of
    torch's memory formats by name (``_torch_attr``): pickle would look for the module of a
    ``torch.contiguous_format`` (it names none) through every module loaded, 100-200 µs for each message
    that holds one (a training step's ``clone`` ops do)."""
    global _pickler
    if _pickler is None:
        import torch

        table = dict(copyreg.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        table[torch.memory_format] = _reduce_torch_attr
        _pickler = type("_TorchPickler", (pickle.Pickler,), {"dispatch_table": table})
    return _pickler


def _reduce_torch_attr(x):
    return _torch_attr, (str(x).removeprefix("torch."),)


def _torch_attr(name: str):
    """``torch.<name>``: a memory format, unpickled (``_reduce_torch_attr``)."""
    import torch

    return getattr(torch, name)


def _reduce_tensor(t):
    import torch

    if t.device.type not in ("cpu", "cuda") or t.requires_grad or not t.is_contiguous() or t.is_sparse \
            or t.is_quantized:
        return t.__reduce_ex__(5)
    if t.is_conj() or t.is_neg():  # a lazy view, whose bytes are not its values: sent as its values
        t = t.resolve_conj().resolve_neg()
    cuda = t.device.type == "cuda"
    if cuda:  # its bytes travel as a CPU tensor's would (out of band: on the data plane when large)
        t = t.to("cpu")
    # (as_strided, not reshape(-1): a contiguous tensor's size-1 dims may have any stride, e.g. x[:, 0] of a batch
    # of one, and reshape keeps it, which view(uint8) refuses)
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if not cuda and flat.numel() <= INBAND_BYTES:  # (a loss, a metric: its bytes in the body, one frame)
        return _rebuild_small_tensor, (flat.numpy().tobytes(), t.dtype, tuple(t.shape))
    return _rebuild_cuda_tensor if cuda else _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()), t.dtype,
                                                               tuple(t.shape))


# A CPU tensor of up to this many bytes travels inside its message's body, not as a frame of its own: the
# message stays one frame, which zmq copies (``is_small``) instead of sending a buffer zero-copy, whose
# bookkeeping costs more than copying a few hundred bytes.
INBAND_BYTES = 1024


def _rebuild_tensor(buf, dtype, shape):
    import torch

    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    t = torch.frombuffer(mv, dtype=torch.uint8)
    if t.data_ptr() % dtype.itemsize:
        # A frame's bytes may sit at any address (zmq keeps a small frame's inside its message, 12 bytes
        # past a 16-byte boundary, say), and torch's kernels assume data aligned to the dtype: a 3-element
        # complex128 tensor there crashed the process that used it (SIGSEGV). Copied: the copy is aligned.
        t = t.clone()
    return t.view(dtype).reshape(shape)


def _rebuild_small_tensor(data: bytes, dtype, shape):
    """A tensor of up to ``INBAND_BYTES`` sent in its message's body: its own copy of ``data`` (a bytearray,
    which Python allocates 16-byte aligned, as torch's kernels need)."""
    import torch

    if not data:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    return t if len(shape) == 1 else t.reshape(shape)


def _rebuild_cuda_tensor(buf, dtype, shape):
    """A CUDA tensor sent from another process: on this process's current GPU (each proc of a mesh has its
    own as cuda:0), or on the CPU where this process has none (a controller without a GPU)."""
    import torch

    t = _rebuild_tensor(buf, dtype, shape)
    return t.to(torch.cuda.current_device()) if torch.cuda.is_available() else t


def is_small(frames: list) -> bool:
    """Whether copying the frames into zmq beats zero-copy (it does below ~64 KiB)."""
    return len(frames) == 1 and len(frames[0]) < 65536


# A run of compact envelopes made of immutable builtin values only (calls and replies whose arguments and
# values are numbers, strings, None and tuples of them: most of a burst's), pickled together as one message
# ``("\0many", [envelope, ...])`` when a batch leaves (``Mailbox.send_plain``): one pickle call and one
# unpickle for the run instead of one of each per message, and the run's repeated strings (actor, method,
# reply address) written once. Immutable, so that what leaves later is what was sent (a list the caller
# changes after the call is pickled at once, as any other message).
MANY = "\0many"
_MANY_MAX = 16384  # bytes (estimated by ``frozen_size``) of a message that may wait in a batch as its envelope
_BIG_INT = 1 << 63  # (ints beyond it pickle longer than 9 bytes)


class Many(list):
    """What a ``"\0many"`` envelope decodes to: its messages, in order; the receiver takes each in turn."""


def frozen_size(x, depth: int = 3) -> int:
    """About how many bytes ``x`` pickles to, when it is built of immutable builtin values only (numbers,
    strings, bytes, None, and tuples of them up to ``depth`` deep) and is small (``_MANY_MAX``); else -1.
    Such a value pickles the same now and later, and its encoding can neither fail nor need anything but
    pickle itself (no tensor, no class, nothing of ``__main__``)."""
    if type(x) is not tuple:
        return frozen_size((x,), depth) if type(x) in _PLAIN_TYPES else -1
    total = 2
    for y in x:  # (this runs for every call and reply: the usual types first, no call per item)
        ty = type(y)
        if ty is str:
            total += len(y) * 4 + 5  # (at most 4 bytes a character)
        elif ty is int:
            total += 9 if -_BIG_INT < y < _BIG_INT else y.bit_length() // 8 + 16
        elif ty is float or y is None or ty is bool:
            total += 9
        elif ty is bytes:
            total += len(y) + 5
        elif ty is tuple and depth > 1:
            n = frozen_size(y, depth - 1)
            if n < 0:
                return -1
            total += n
        else:
            return -1
    return total if total <= _MANY_MAX else -1


def encode_plain(envelope: tuple) -> bytes:
    """The one frame of a compact envelope that ``frozen_size`` accepts: what ``encode`` gives for its message."""
    return _HEADER.pack(MAGIC, 0) + pickle.dumps(envelope, protocol=5)


def pack_runs(items: list) -> list:
    """The frames of a batch's items, in order: each a one-frame message (bytes), or a compact envelope of
    plain values (a tuple); every run of the latter becomes one ``"\0many"`` message."""
    frames: list = []
    for envelopes, group in itertools.groupby(items, lambda item: type(item) is tuple):
        if envelopes:
            run = list(group)
            frames.append(encode_plain(run[0] if len(run) == 1 else (MANY, run)))
        else:
            frames.extend(group)
    return frames


def _expand_many(t: tuple) -> Many:
    if len(t) != 2 or type(t[1]) is not list:
        raise ProtocolError(f"a run of messages is a tag and a list, got {len(t)} items")
    return Many([_expand(e) for e in t[1]])


COMPACT_DECODERS[MANY] = _expand_many


def pack_batch(frames: list) -> bytes:
    """One frame holding several one-frame messages (see :func:`unpack_batch`)."""
    parts = [_HEADER.pack(MAGIC_BATCH, len(frames))]
    for f in frames:
        parts.append(_LEN.pack(len(f)))
        parts.append(f)
    return b"".join(parts)


def is_batch(first) -> bool:
    return first[:4] == MAGIC_BATCH


def unpack_batch(frame) -> list[memoryview]:
    """The messages of a batch frame, each as its one frame; ``ProtocolError`` if malformed."""
    view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    if len(view) < _HEADER.size:
        raise ProtocolError("batch frame shorter than its header")
    _, n = _HEADER.unpack_from(view)
    pos = _HEADER.size
    out: list[memoryview] = []
    for _ in range(n):
        if pos + _LEN.size > len(view):
            raise ProtocolError(f"batch frame of {len(view)} bytes ends inside message {len(out)} of {n}")
        (size,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if pos + size > len(view):
            raise ProtocolError(f"batch frame of {len(view)} bytes ends inside message {len(out)} of {n}")
        out.append(view[pos:pos + size])
        pos += size
    if pos != len(view):
        raise ProtocolError(f"batch frame has {len(view) - pos} bytes after its {n} messages")
    return out


def buffer_count(first: bytes) -> int:
    """How many buffer frames the first frame's header announces (0 if malformed)."""
    if len(first) < _HEADER.size:
        return 0
    magic, nbuf = _HEADER.unpack_from(first)
    return nbuf if magic in _MAGICS else 0


def decode(frames: list) -> object:
    """Inverse of :func:`encode`; raises ``ProtocolError`` on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    first = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
    if len(first) < _HEADER.size:
        raise ProtocolError(f"first frame of {len(first)} bytes is shorter than the header")
    magic, nbuf = _HEADER.unpack_from(first)
    if magic not in _MAGICS:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if nbuf != len(frames) - 1:
        raise ProtocolError(f"header announces {nbuf} buffers, got {len(frames) - 1}")
    body = memoryview(first)[_HEADER.size:]
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames[1:]]
    if magic != MAGIC and nbuf != 1:
        raise ProtocolError(f"a message of magic {bytes(magic)!r} has one descriptor frame, got {nbuf}")
    if magic == MAGIC_SHM:
        bufs = _map_shm(body, bufs[0])
    elif magic == MAGIC_DP:
        bufs = _pull(body, bufs[0])
    try:
        return _loads(body, bufs)
    except Exception as e:  # any unpickling failure is a protocol error
        try:
            envelope = _salvage(body, bufs)
        except Exception:  # noqa: BLE001 - not even the envelope: a malformed message
            raise ProtocolError(f"cannot unpickle message body: {e!r}") from e
        error = ProtocolError(f"cannot unpickle {_describe(envelope)} where it arrived: {e!r}")
        error.__cause__ = e
        raise Unreadable(error, envelope) from e


_decoding = threading.local()


def loads_plain(frame) -> object:
    """The unpickled body of a one-frame message without buffers, compact envelopes left as tuples (a chunk's
    entries, read in bulk); ``ProtocolError`` for any other frame."""
    if len(frame) < _HEADER.size:
        raise ProtocolError("frame shorter than the header")
    magic, nbuf = _HEADER.unpack_from(frame)
    if magic != MAGIC or nbuf:
        raise ProtocolError("not a one-frame message")
    prev = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        return pickle.loads(memoryview(frame)[_HEADER.size:])
    finally:
        _decoding.on = prev


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not a builtin value")


def loads_builtin(frame) -> object:
    """As :func:`loads_plain`, for a body made of builtin values only (numbers, strings, bytes, None, and tuples,
    lists, dicts and sets of them): no class is looked up, so nothing of the sender's code runs here, and the
    value pickles back to the same; ``pickle.UnpicklingError`` for any other body."""
    if len(frame) < _HEADER.size:
        raise ProtocolError("frame shorter than the header")
    magic, nbuf = _HEADER.unpack_from(frame)
    if magic != MAGIC or nbuf:
        raise ProtocolError("not a one-frame message")
    return _BuiltinsOnly(io.BytesIO(memoryview(frame)[_HEADER.size:])).load()


def decoding() -> bool:
    """Whether this thread is unpickling a message (the tensor engine's factories then make plain tensors)."""
    return getattr(_decoding, "on", False)


def _loads(body, bufs) -> object:
    prev = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        msg = pickle.loads(body, buffers=bufs)
    finally:
        _decoding.on = prev
    return _expand(msg)


def _expand(msg: object) -> object:
    """A compact envelope (a tuple tagged with a string) as its message; anything else as it is."""
    if type(msg) is tuple and msg and type(msg[0]) is str:  # (other tuples are messages of their own)
        decoder = COMPACT_DECODERS.get(msg[0])
        if decoder is not None:
            return decoder(msg)
    return msg


class _Stub:
    """Stands for whatever in a message could not be rebuilt where it arrived (a class its receiver cannot
    import, a reducer that raises there), so that the rest of the message, its reply port, can be read."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> "_Stub":
        return _Stub()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __setstate__(self, state) -> None:
        pass

    def append(self, item) -> None:
        pass

    def extend(self, items) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        pass

    def add(self, item) -> None:
        pass


# Modules of the records that carry messages (their reply ports): what a salvage rebuilds when nothing
# else can be. The transport's own; the layers above add theirs (``add_envelope_modules``): the hosts' and the
# tools' protocol modules in monarch_tensor/__init__.py, the tensor engine's instructions in worker/messages.py.
ENVELOPE_MODULES = {"builtins", "copyreg", "monarch_tensor.transport.messages", "monarch_tensor.errors"}


def add_envelope_modules(*names: str) -> None:
    """Let a salvage rebuild the records of modules ``names`` (a protocol's messages) too."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"envelope modules are module names ('package.module'), got {name!r}")
    ENVELOPE_MODULES.update(names)


# pickle's pure-Python unpickler's methods that _SalvageUnpickler wraps (typeshed does not declare them)
_BASE: dict[str, Callable[..., None]] = {k: vars(pickle._Unpickler)[k] for k in ("load_build", "_instantiate")}


class _SalvageUnpickler(pickle._Unpickler):
    """Reads a message whose body failed to unpickle, leaving out only what failed: a global its receiver
    cannot import, and whatever a reducer or ``__setstate__`` that raises here was rebuilding, become
    :class:`_Stub`. Pure Python (its opcodes can be wrapped): only for messages that already failed."""

    dispatch: ClassVar[dict[int, Callable[..., None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # (pickle's pure-Python unpickler sets these two in load(); typeshed leaves them out)
    append: Callable[[Any], None]

    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except Exception:  # noqa: BLE001
            return _Stub

    def _made(self, make: Callable, *args, **kwargs) -> object:
        try:
            return make(*args, **kwargs)
        except Exception:  # noqa: BLE001 - this piece of the message stays unreadable
            return _Stub()

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._made(self.stack[-1], *args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._made(lambda: cls.__new__(cls, *args)))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._made(lambda: cls.__new__(cls, *args, **kwargs)))

    def load_build(self) -> None:
        try:
            _BASE["load_build"](self)  # pops the state first, then sets it on the object below
        except Exception:  # noqa: BLE001
            self.stack[-1] = _Stub()

    def _instantiate(self, klass, args) -> None:
        try:
            _BASE["_instantiate"](self, klass, args)  # appends the object once it is made
        except Exception:  # noqa: BLE001
            self.append(_Stub())

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


class _EnvelopeUnpickler(pickle.Unpickler):
    """The last resort: everything but builtins and the runtime's own records is a stub."""

    def find_class(self, module: str, name: str):
        if module not in ENVELOPE_MODULES:
            return _Stub
        return super().find_class(module, name)


def _salvage(body, bufs) -> object:
    """The message as far as it can be read; raises when not even its envelope can."""
    try:
        msg = _SalvageUnpickler(io.BytesIO(body), buffers=bufs).load()
    except Exception:  # noqa: BLE001 - keep only the envelope
        msg = _EnvelopeUnpickler(io.BytesIO(body), buffers=bufs).load()
    return _expand(msg)


def envelopes(frames: list) -> list:
    """The records that ``frames`` (one message or a batch of them) travel in, with their reply ports, their
    payloads left unread (stubs): for a relay that cannot deliver them and tells their senders. ``[]`` where
    even the envelope cannot be read."""
    first = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
    messages = [[m] for m in unpack_batch(first)] if is_batch(first) else [frames]
    out: list = []
    for msg in messages:
        head = memoryview(msg[0])
        if len(head) < _HEADER.size or _HEADER.unpack_from(head)[0] not in _MAGICS:
            continue
        try:  # any buffer (a tensor's bytes, a shared-memory or data-plane descriptor) reads as empty
            body = io.BytesIO(head[_HEADER.size:])
            got = _expand(_EnvelopeUnpickler(body, buffers=iter(lambda: b"", None)).load())
        except Exception:  # noqa: BLE001 - not even the envelope: nothing to tell
            continue
        if type(got) is Many:
            out.extend(got)
        else:
            out.append(got)
    return out


def holds(obj: object, kinds: tuple[type, ...] = (_Stub,), budget: int = 100_000) -> bool:
    """Whether ``obj`` (a piece of a message that could not be read whole) holds an instance of ``kinds``
    (by default: something that could not be unpickled here); True also when it is too large to look
    through in ``budget`` steps."""
    stack: list[Any] = [obj]
    seen: set[int] = set()
    while stack:
        budget -= 1
        if budget < 0:
            return True
        o = stack.pop()
        if isinstance(o, kinds):
            return True
        t = type(o)
        if t in (str, bytes, int, float, bool, type(None)) or id(o) in seen:
            continue
        seen.add(id(o))
        if t in (tuple, list, set, frozenset):
            stack.extend(o)
        elif t is dict:
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (type, types.ModuleType)):
            continue
        elif isinstance(o, types.FunctionType):
            stack.extend(o.__defaults__ or ())
            for cell in o.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        else:
            d = getattr(o, "__dict__", None)
            if type(d) is dict:
                stack.extend(d.values())
            for k in t.__mro__:
                slots = k.__dict__.get("__slots__", ())
                for slot in (slots,) if isinstance(slots, str) else slots:
                    if slot not in ("__dict__", "__weakref__") and hasattr(o, slot):
                        stack.append(getattr(o, slot))
    return False


def _describe(msg: object) -> str:
    if isinstance(msg, _Stub):
        return "a message"
    actor, method = getattr(msg, "actor", None), getattr(msg, "method", None)
    if isinstance(actor, str) and isinstance(method, str):
        return f"the arguments of {actor}.{method}"
    if hasattr(msg, "port_id") and hasattr(msg, "value"):
        return "a reply"
    return f"a {type(msg).__name__} message"


def _map_shm(body: memoryview, desc) -> list:
    try:
        d = pickle.loads(desc)  # (name, layout, reader index)
        layout = list(d[1])
    except Exception as e:
        raise ProtocolError(f"cannot read the message's shared-memory descriptor: {e!r}") from e
    try:
        return _shm.read(*d)
    except Exception as e:  # rebuild the message over zeros to fail whoever waits on it
        try:
            import numpy as np

            msg = _loads(body, [memoryview(np.zeros(n, dtype=np.uint8)) for _, n in layout])  # (calloc: untouched)
        except Exception:  # noqa: BLE001
            msg = None
        why = repr(e)
        if isinstance(e, OSError) and e.errno == errno.EMFILE:  # (the bare errno read as a shared-memory fault)
            why += ": this process has no file descriptor left (raise its limit, `ulimit -n`, or close some)"
        error = ProtocolError(f"cannot map the shared-memory buffers ({d[0]}) of {_describe(msg)} where it "
                              f"arrived: {why}")
        raise PayloadLost(error, msg) from e


def _pull(body: memoryview, desc) -> list:
    try:
        payload = pickle.loads(desc)
    except Exception as e:
        raise ProtocolError(f"cannot read the message's data-plane payload descriptor: {e!r}") from e
    try:
        return _payload().pull(payload)
    except Exception as e:  # rebuild the message over zeros to fail whoever waits on it
        try:
            msg = _loads(body, _payload().placeholders(payload))
        except Exception:  # noqa: BLE001
            msg = None
        raise PayloadLost(e, msg) from e
