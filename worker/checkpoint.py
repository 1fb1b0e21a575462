"""``torch.distributed.checkpoint`` on a worker: each rank plans, writes and reads its own shards.

DCP's ``save``/``load`` coordinate their ranks through the default process
group, which the engine leaves to user code (``worker/dtensor.py``). So their
steps run here one by one, as DCP's ``_save_state_dict``/``_load_state_dict``
order them, and the controller carries the small records between them (each
rank's local plan to the coordinator, the coordinator's global plan back, the
write results to the coordinator); tensor data never leaves the workers. Rank
0 of the mesh is DCP's coordinator: it makes the global plan and writes
``.metadata``. The planner and storage objects are DCP's own (by default
``DefaultSavePlanner``/``FileSystemWriter`` and
``DefaultLoadPlanner``/``FileSystemReader``), so the files are DCP's and a
torch job (``dcp.load`` under torchrun, or ``dcp_to_torch_save``) reads them.

A save or load in progress is kept in ``_pending`` under the controller's
token until its last step, or until the controller ``drop``s it after a
failure on another rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)


@dataclass
class _Step:
    planner: Any
    storage: Any
    state_dict: dict
    is_coordinator: bool
    metadata: Any = None


_pending: dict[str, _Step] = {}
_lock = threading.Lock()


def _take(token: str, keep: bool) -> _Step:
    with _lock:
        step = _pending.get(token) if keep else _pending.pop(token, None)
    if step is None:
        raise RuntimeError(f"checkpoint {token}: no save or load in progress on this proc (dropped after a "
                           f"failure on another rank, or its proc restarted)")
    return step


def drop(token: str) -> None:
    """Forget the save or load ``token`` (another rank failed it)."""
    with _lock:
        _pending.pop(token, None)


# ---- save: local plan -> (coordinator) global plan -> write -> (coordinator) finish -------------------------
def save_plan(token: str, state_dict: dict, rank: int, checkpoint_id, storage_writer, planner):
    """Set up DCP's planner and writer for this rank's ``state_dict``; its local save plan."""
    writer = storage_writer if storage_writer is not None else FileSystemWriter(checkpoint_id)
    if storage_writer is not None and checkpoint_id is not None:
        writer.reset(checkpoint_id)
    planner = planner if planner is not None else DefaultSavePlanner()
    coordinator = rank == 0
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    with _lock:
        _pending[token] = _Step(planner, writer, state_dict, coordinator)
    return plan


def save_global(token: str, plans: list) -> list:
    """(Coordinator) the global plan: one plan per rank; keeps the checkpoint's metadata for ``save_finish``."""
    step = _take(token, keep=True)
    plans, step.metadata = step.planner.create_global_plan(plans)
    return step.storage.prepare_global_plan(plans)


def save_write(token: str, plan) -> list:
    """Write this rank's part of the checkpoint (its shards); the write results."""
    step = _take(token, keep=True)
    if not step.is_coordinator:
        drop(token)
    work = step.storage.write_data(step.planner.finish_plan(plan), step.planner)
    work.wait()
    return work.value()


def save_finish(token: str, results: list):
    """(Coordinator) write ``.metadata`` from every rank's write results: the checkpoint is complete. Returns
    DCP's ``Metadata`` (what each file holds: shapes, chunks, offsets; no tensor data)."""
    step = _take(token, keep=False)
    step.storage.finish(metadata=step.metadata, results=results)
    return step.metadata


# ---- load: local plan -> (coordinator) global plan -> read ----------------------------------------------------
def load_plan(token: str, state_dict: dict, rank: int, checkpoint_id, storage_reader, planner):
    """Read the checkpoint's metadata and plan the reads into this rank's ``state_dict``; the local plan."""
    reader = storage_reader if storage_reader is not None else FileSystemReader(checkpoint_id)
    if storage_reader is not None and checkpoint_id is not None:
        reader.reset(checkpoint_id)
    planner = planner if planner is not None else DefaultLoadPlanner()
    coordinator = rank == 0
    metadata = reader.read_metadata()
    planner.set_up_planner(state_dict, metadata, coordinator)
    reader.set_up_storage_reader(metadata, coordinator, rank=rank, use_collectives=True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    with _lock:
        _pending[token] = _Step(planner, reader, state_dict, coordinator)
    return plan


def load_global(token: str, plans: list) -> list:
    """(Coordinator) the global load plan: one plan per rank."""
    step = _take(token, keep=True)
    return step.storage.prepare_global_plan(step.planner.create_global_plan(plans))


def load_read(token: str, plan, paths: list) -> list:
    """Read into this rank's tensors (in place); the values at ``paths`` (the entries that were not mesh
    tensors: DCP replaces those, and the controller takes them back)."""
    step = _take(token, keep=False)
    work = step.storage.read_data(step.planner.finish_plan(plan), step.planner)
    work.wait()
    out = []
    for path in paths:
        node = step.state_dict
        for key in path:
            node = node[key]
        out.append(node)
    return out


def pending() -> int:
    """How many saves and loads this proc holds between their steps (a test and debugging aid)."""
    with _lock:
        return len(_pending)
