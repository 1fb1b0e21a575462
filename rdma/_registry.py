"""The owner's side: registered buffers, and one 8-byte slot per registration.

A registration's slot holds its id while it lives and 0 once dropped. The
slot is ordinary memory of the owner, so a reader on the same host checks it
with the same one-sided call it reads the data with (the owner does nothing),
and a dropped buffer is refused before any byte moves.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from ._host import host_id, own_start_time, per_process
from ._memory import Mem

_SLOTS_PER_PAGE = 4096


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What travels in a handle: where the buffer is and how each backend reaches it."""

    buf_id: int
    token: int  # a secret: the tcp server serves a buffer only to whoever holds it
    nbytes: int
    device: str
    writable: bool
    host: str
    pid: int
    started: int
    owner: str  # the owner's mailbox address ("" where it has none)
    addr: int
    slot_addr: int
    tcp: tuple[str, int] | None = None
    extras: dict = field(default_factory=dict)  # per backend: "cuda_ipc", "verbs"


@dataclass
class Registration:
    desc: Descriptor
    mem: Mem
    slot: int
    cache: dict = field(default_factory=dict)  # backends' per-registration state (opened handles, MRs)


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[int, Registration] = {}
        self.pages: list[Any] = []
        self.free: list[int] = []
        self.ids = itertools.count(1)
        self.on_drop: list = []  # backends' hooks (deregister MRs ...)

    def _slot(self) -> int:
        if not self.free:
            base = len(self.pages) * _SLOTS_PER_PAGE
            self.pages.append((ctypes.c_uint64 * _SLOTS_PER_PAGE)())
            self.free.extend(range(base + _SLOTS_PER_PAGE - 1, base - 1, -1))
        return self.free.pop()

    def slot_addr(self, slot: int) -> int:
        page = self.pages[slot // _SLOTS_PER_PAGE]
        return ctypes.addressof(page) + 8 * (slot % _SLOTS_PER_PAGE)

    def register(self, mem: Mem, owner: str, tcp: tuple[str, int] | None, extras: dict) -> Registration:
        with self.lock:
            buf_id = next(self.ids)
            slot = self._slot()
            self.pages[slot // _SLOTS_PER_PAGE][slot % _SLOTS_PER_PAGE] = buf_id
            desc = Descriptor(buf_id, secrets.randbits(63), mem.nbytes, mem.device, mem.writable, host_id(),
                              os.getpid(), own_start_time(), owner, mem.ptr, self.slot_addr(slot), tcp,
                              extras)
            reg = Registration(desc, mem, slot)
            self.by_id[buf_id] = reg
            return reg

    def lookup(self, buf_id: int, token: int) -> Registration | None:
        reg = self.by_id.get(buf_id)
        return reg if reg is not None and reg.desc.token == token else None

    def drop(self, buf_id: int) -> bool:
        with self.lock:
            reg = self.by_id.pop(buf_id, None)
            if reg is None:
                return False
            self.pages[reg.slot // _SLOTS_PER_PAGE][reg.slot % _SLOTS_PER_PAGE] = 0
            self.free.append(reg.slot)
        for hook in self.on_drop:
            hook(reg)
        return True


@per_process
def registry() -> Registry:
    """This process's registry (a forked child starts with an empty one)."""
    return Registry()
