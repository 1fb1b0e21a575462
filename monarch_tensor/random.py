"""The workers' random state as mesh tensors (Monarch's ``monarch.random``), inside ``with mesh.activate():``.

>>> saved = get_state()                      # State(cpu, cuda): each rank's generator states
>>> x = torch.randn(4)
>>> set_state(saved)
>>> torch.randn(4)                          # the same numbers again, on every rank
>>> other = new_state(mesh.rank("gpus"))     # a state seeded per rank, the current one left as it was

``cuda`` is the state of the worker's current GPU, an empty tensor on a worker without one.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from monarch_tensor.controller.api import remote
from monarch_tensor.controller.tensor import Tensor


class State(NamedTuple):
    cpu: Tensor
    cuda: Tensor


def _cuda_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0, dtype=torch.uint8)


def _get_state() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.get_rng_state(), _cuda_state()


def _set_state(state: tuple[torch.Tensor, torch.Tensor]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda.numel():
        torch.cuda.set_rng_state(cuda)


def _manual_seed(seed) -> None:
    torch.manual_seed(int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed))


def _make_deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


# (the functions travel by name: the workers import this module)
_get_state_remote = remote(_get_state, propagate="inspect")  # a GPU state's size depends on the worker: asked once
set_state = remote(_set_state, propagate=lambda state: None)
_manual_seed_remote = remote(_manual_seed, propagate=lambda seed: None)
make_deterministic = remote(_make_deterministic, propagate=lambda: None)
make_deterministic.__doc__ = "Deterministic algorithms on every rank (and the cuBLAS setting they need)."


def get_state() -> State:
    return State(*_get_state_remote())


def new_state(seed) -> State:
    """The state that ``seed`` (an int, or a mesh tensor: one seed per rank) gives; the current one is kept."""
    orig = get_state()
    _manual_seed_remote(seed)
    mine = get_state()
    set_state(orig)
    return mine
