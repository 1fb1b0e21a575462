"""The workers' random number generators (Monarch's ``monarch.builtins.random``), called inside
``with mesh.activate():``. ``set_manual_seed_remote(seed)`` gives every rank the same stream;
``set_manual_seed_remote(seed, process_idx=mesh.rank("gpus"))`` a different one per rank. The CUDA
forms act on the workers' GPUs (a clear error from torch where a worker has none)."""

from __future__ import annotations

import torch

from monarch_tensor.controller.api import remote

_CPU_STATE_BYTES = torch.get_rng_state().numel()


def _none(*args, **kwargs) -> None:
    return None


def _manual_seed(seed: int, process_idx: int = 0) -> None:
    torch.manual_seed(int(seed) ^ int(process_idx))


def _cuda_manual_seed(seed: int) -> None:
    torch.cuda.manual_seed(int(seed))


def _cuda_manual_seed_all(seed: int) -> None:
    torch.cuda.manual_seed_all(int(seed))


# (the functions travel by name: the workers import this module)
set_manual_seed_remote = remote(_manual_seed, propagate=_none)
get_rng_state_remote = remote("torch.get_rng_state",
                              propagate=lambda: torch.empty(_CPU_STATE_BYTES, dtype=torch.uint8))
set_rng_state_remote = remote("torch.set_rng_state", propagate=_none)
seed_remote = remote("torch.seed", propagate=_none)
random_seed_remote = remote("torch.random.seed", propagate=_none)
manual_seed_cuda_remote = remote(_cuda_manual_seed, propagate=_none)
manual_seed_all_cuda_remote = remote(_cuda_manual_seed_all, propagate=_none)
# one state per GPU of the worker: rank 0 is asked how many (once)
get_rng_state_all_cuda_remote = remote("torch.cuda.get_rng_state_all", propagate="inspect")
set_rng_state_all_cuda_remote = remote("torch.cuda.set_rng_state_all", propagate=_none)
