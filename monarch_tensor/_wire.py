"""The wire format: one header frame, one pickle-5 body, raw buffer frames.

``encode(msg)`` returns a list of frames for ``socket.send_multipart(copy=False)``:
the header (a magic tag and the number of buffers), the body (``msg`` pickled
with protocol 5, out-of-band buffers left out), and then each out-of-band
buffer (tensor or ndarray bytes) as its own frame, never copied into the body.
Plain pickle does the pickling; a message that refers to ``__main__`` (classes
and functions of a script or notebook) or holds something pickle refuses (a
lambda, a local class) is pickled again with cloudpickle so that code travels
by value. Everything importable travels by reference.
"""

from __future__ import annotations

import pickle
import struct

import cloudpickle

from .errors import ProtocolError

MAGIC = b"MT01"
_HEADER = struct.Struct("!4sI")
_MAIN = b"__main__"


def encode(msg: object) -> list:
    """Frames for ``msg``: header, body, then out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        body = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
        by_value = _MAIN in body
    except (pickle.PicklingError, AttributeError, TypeError):
        by_value = True
    if by_value:
        buffers.clear()
        body = cloudpickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    return [_HEADER.pack(MAGIC, len(buffers)), body, *(b.raw() for b in buffers)]


def is_small(frames: list) -> bool:
    """Whether copying the frames into zmq beats zero-copy (it does below ~64 KiB)."""
    return len(frames) == 2 and len(frames[1]) < 65536


def buffer_count(header: bytes) -> int:
    """How many buffer frames the header announces (0 for a malformed header)."""
    if len(header) != _HEADER.size:
        return 0
    magic, nbuf = _HEADER.unpack(header)
    return nbuf if magic == MAGIC else 0


def decode(frames: list) -> object:
    """Inverse of :func:`encode`; raises ``ProtocolError`` on anything malformed."""
    if len(frames) < 2:
        raise ProtocolError(f"message has {len(frames)} frames, expected at least 2")
    header = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
    if len(header) != _HEADER.size:
        raise ProtocolError(f"bad header of {len(header)} bytes")
    magic, nbuf = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if nbuf != len(frames) - 2:
        raise ProtocolError(f"header announces {nbuf} buffers, got {len(frames) - 2}")
    body = frames[1].buffer if hasattr(frames[1], "buffer") else frames[1]
    bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames[2:]]
    try:
        return pickle.loads(body, buffers=bufs)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a protocol error
        raise ProtocolError(f"cannot unpickle message body: {e!r}") from e
