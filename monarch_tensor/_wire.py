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
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys

import cloudpickle

from . import _shm
from .errors import ProtocolError

MAGIC = b"MT01"
MAGIC_SHM = b"MT02"  # one extra frame: (name, layout) of a shared-memory file holding the buffers
_HEADER = struct.Struct("!4sI")
_MAIN = b"__main__"


def encode(msg: object, shm: bool | int = False) -> list:
    """Frames for ``msg``: header and body, then out-of-band buffers.

    With ``shm`` (the number of receivers, all on this host; ``True`` is one),
    large buffers go through shared memory; :func:`frames_for_reader` gives
    each receiver its frames.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        if "torch" in sys.modules:
            f = io.BytesIO()
            p = pickle.Pickler(f, protocol=5, buffer_callback=buffers.append)
            p.dispatch_table = _torch_dispatch_table()
            p.dump(msg)
            body = f.getvalue()
        else:
            body = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
        by_value = _MAIN in body
    except (pickle.PicklingError, AttributeError, TypeError):
        by_value = True
    if by_value:
        buffers.clear()
        body = cloudpickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    if shm and raws and sum(r.nbytes for r in raws) >= _shm.SHM_THRESHOLD and _shm.available():
        desc = pickle.dumps(_shm.write(raws, readers=int(shm)))
        return [_HEADER.pack(MAGIC_SHM, 1) + body, desc]
    return [_HEADER.pack(MAGIC, len(raws)) + body, *raws]


def frames_for_reader(frames: list, i: int) -> list:
    """The frames receiver ``i`` of ``encode(msg, shm=n)`` gets (its own hold flag on shared memory)."""
    if len(frames) != 2 or bytes(frames[0][:4]) != MAGIC_SHM or i == 0:
        return frames
    return [frames[0], pickle.dumps(_shm.for_reader(pickle.loads(frames[1]), i))]


def encode_for(msg: object, addrs: list[str]) -> list[list]:
    """Frames for each of ``addrs`` (encoded once; shared memory when every receiver is on this host)."""
    local = all(a.startswith("ipc://") for a in addrs)
    frames = encode(msg, shm=len(addrs) if local and len(addrs) <= _shm.MAX_READERS else False)
    return [frames_for_reader(frames, i) for i in range(len(addrs))]


_dispatch: dict | None = None


def _torch_dispatch_table() -> dict:
    """copyreg's table plus a reducer that sends CPU tensors' bytes out of band.

    torch's own pickling ignores protocol 5 and copies tensor bytes into the body.
    """
    global _dispatch
    if _dispatch is None:
        import torch

        table = dict(copyreg.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        _dispatch = table
    return _dispatch


def _reduce_tensor(t):
    import torch

    if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous() or t.is_sparse or t.is_quantized:
        return t.__reduce_ex__(5)
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()), t.dtype, tuple(t.shape))


def _rebuild_tensor(buf, dtype, shape):
    import torch

    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).reshape(shape)


def is_small(frames: list) -> bool:
    """Whether copying the frames into zmq beats zero-copy (it does below ~64 KiB)."""
    return len(frames) == 1 and len(frames[0]) < 65536


def buffer_count(first: bytes) -> int:
    """How many buffer frames the first frame's header announces (0 if malformed)."""
    if len(first) < _HEADER.size:
        return 0
    magic, nbuf = _HEADER.unpack_from(first)
    return nbuf if magic in (MAGIC, MAGIC_SHM) else 0


def decode(frames: list) -> object:
    """Inverse of :func:`encode`; raises ``ProtocolError`` on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    first = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
    if len(first) < _HEADER.size:
        raise ProtocolError(f"first frame of {len(first)} bytes is shorter than the header")
    magic, nbuf = _HEADER.unpack_from(first)
    if magic not in (MAGIC, MAGIC_SHM):
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if nbuf != len(frames) - 1:
        raise ProtocolError(f"header announces {nbuf} buffers, got {len(frames) - 1}")
    body = memoryview(first)[_HEADER.size:]
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames[1:]]
    if magic == MAGIC_SHM:
        try:
            bufs = _shm.read(*pickle.loads(bufs[0]))
        except Exception as e:  # noqa: BLE001
            raise ProtocolError(f"cannot map the message's shared-memory buffers: {e!r}") from e
    try:
        return pickle.loads(body, buffers=bufs)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a protocol error
        raise ProtocolError(f"cannot unpickle message body: {e!r}") from e
