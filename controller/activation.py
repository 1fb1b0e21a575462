"""Mesh activation: a proc mesh's tensor-engine client, ``with procs.activate():``, ``no_mesh``, the active
mesh, and the per-rank tensors made from a mesh's shape.

>>> with procs.activate():
...     x = torch.ones(4) + procs.rank_tensor("gpus")
"""

from __future__ import annotations

import contextlib
import threading

import torch
from monarch_tensor.worker import messages as m

from . import torch_patches
from .client import Ctx, MeshClient
from .streams import _MAIN, Stream
from .tensor import Tensor, contiguous_meta, intern_meta, state


# ---- meshes ------------------------------------------------------------------------------------------
def client_for(pm) -> MeshClient:
    alloc = pm._alloc
    c = getattr(alloc, "_tensor_client", None)
    if alloc._stopped:
        pm._check_alive()  # raises MeshStoppedError
    if c is None:
        with _client_lock:  # (two threads activating a fresh mesh at once: one client, one worker actor)
            c = getattr(alloc, "_tensor_client", None)
            if c is None:
                pm._check_alive()
                c = alloc._tensor_client = MeshClient(alloc)
                torch_patches.install_optimizer_hook()
    return c


_client_lock = threading.Lock()


def ctx_for(pm, stream: Stream | None = None) -> Ctx:
    return client_for(pm).ctx(pm, stream or state.stream or _MAIN)


@contextlib.contextmanager
def activate(pm):
    """``with proc_mesh.activate():`` factories (``torch.zeros``, modules...) make tensors on ``pm``."""
    torch_patches.install_factories()
    client_for(pm)
    prev = state.ctx_mesh
    state.ctx_mesh = pm
    try:
        yield pm
    finally:
        state.ctx_mesh = prev


class _NoMesh:
    """``with no_mesh():`` (or ``no_mesh.activate()``): factories make ordinary local tensors again."""

    @contextlib.contextmanager
    def activate(self):
        prev = state.ctx_mesh
        state.ctx_mesh = None
        try:
            yield
        finally:
            state.ctx_mesh = prev

    def __call__(self):
        return self.activate()


no_mesh = _NoMesh()


def get_active_mesh():
    """The proc mesh of the innermost ``with procs.activate():`` (Monarch's); a ValueError outside one."""
    if state.ctx_mesh is None:
        raise ValueError("no mesh is active: get_active_mesh() works inside `with procs.activate():`")
    return state.ctx_mesh


def rank_tensor(pm, dim: str) -> Tensor:
    """Each rank's coordinate along ``dim`` as a 0-dim int64 mesh tensor: ``procs.rank_tensor("gpus")``."""
    if dim not in pm._shape.names:
        raise KeyError(f"mesh has no dimension {dim!r}; its dimensions are {list(pm._shape.names)}")
    ctx = ctx_for(pm)
    shape = pm._shape
    coords = {r: shape.point(i)[dim] for i, r in enumerate(shape.ranks())}
    ref = next(ctx.client.refs)
    ctx.client.issue(m.CreateRank(ref, coords, ctx.sid), ctx.ranks)
    meta = contiguous_meta((), torch.int64)
    return Tensor(meta, intern_meta(meta), ctx, ref)


def worker_stats(pm, rank: int = 0) -> dict:
    """Counts of live refs, streams and borrows on one worker (a debugging and test aid)."""
    ctx = ctx_for(pm)
    return ctx.client.request(ctx.ranks[rank], lambda port: m.ReportRefs(port, ctx.sid), "worker stats").result(60)
