"""Monarch's monarch.builtins (random, log) and monarch.random: the workers' generators from the controller,
against local torch seeded the same way."""

import logging
import time

import pytest
import torch
from _device import WORKER_DEVICE

from monarch_tensor import inspect, no_mesh
from monarch_tensor.builtins import log_remote, set_logging_level_remote
from monarch_tensor.builtins.random import (
    get_rng_state_all_cuda_remote,
    get_rng_state_remote,
    random_seed_remote,
    seed_remote,
    set_manual_seed_remote,
    set_rng_state_all_cuda_remote,
    set_rng_state_remote,
)
from monarch_tensor.random import State, get_state, make_deterministic, new_state, set_state

pytestmark = pytest.mark.timeout(120)


def _local(seed: int) -> torch.Tensor:
    with no_mesh():
        g = torch.Generator(WORKER_DEVICE).manual_seed(seed)
        return torch.randn(4, generator=g, device=WORKER_DEVICE).cpu()


def test_seeding_the_workers_matches_local_torch(mesh):
    with mesh.activate():
        set_manual_seed_remote(7)
        same = torch.randn(4)
        set_manual_seed_remote(7, process_idx=mesh.rank("gpus"))  # a seed per rank: 7 ^ rank
        per_rank = torch.randn(4)
        for r in range(2):
            torch.testing.assert_close(inspect(same, gpus=r), _local(7))
            torch.testing.assert_close(inspect(per_rank, gpus=r), _local(7 ^ r))


def test_a_data_loader_draws_from_rank_0s_generator_when_the_ranks_differ(mesh):
    """torch.utils.data draws from the workers' generator (see test_engine's data loader tests); with a seed per
    rank it draws from rank 0's, and the ranks' generators keep their states."""
    from torch.utils.data import DataLoader

    with mesh.activate():
        set_manual_seed_remote(7, process_idx=mesh.rank("gpus"))
        order = [b.tolist() for b in DataLoader(list(range(10)), batch_size=5, shuffle=True)]
        after = torch.randn(4)
        got = [inspect(after, gpus=r) for r in range(2)]
    with no_mesh():
        torch.manual_seed(7)
        want_order = [b.tolist() for b in DataLoader(list(range(10)), batch_size=5, shuffle=True)]
    assert order == want_order
    for r in range(2):
        torch.testing.assert_close(got[r], _local(7 ^ r))


def test_a_saved_generator_state_replays_the_same_numbers(mesh):
    cuda = WORKER_DEVICE.type == "cuda"  # the workers' tensors, so their random numbers, are on their GPU
    get_state = get_rng_state_all_cuda_remote if cuda else get_rng_state_remote
    set_state_ = set_rng_state_all_cuda_remote if cuda else set_rng_state_remote
    with mesh.activate():
        set_manual_seed_remote(3)
        saved = get_state()
        if not cuda:
            assert inspect(saved, gpus=0).dtype == torch.uint8
        a = torch.randn(4)
        seed_remote()  # (nondeterministic reseeds)
        random_seed_remote()
        set_state_(saved)
        b = torch.randn(4)
        torch.testing.assert_close(inspect(a, gpus=1), inspect(b, gpus=1))


def test_monarch_random_get_set_and_new_state(mesh):
    with mesh.activate():
        set_manual_seed_remote(11)
        state = get_state()
        assert isinstance(state, State)
        assert inspect(state.cuda, gpus=0).numel() == (16 if WORKER_DEVICE.type == "cuda" else 0)
        first = torch.randn(4)
        seeded = new_state(mesh.rank("gpus") + 100)  # the current state stays as it was
        second = torch.randn(4)
        set_state(state)
        again = torch.randn(4)
        set_state(seeded)
        from_seed = torch.randn(4)
        make_deterministic()
        for r in range(2):
            torch.testing.assert_close(inspect(first, gpus=r), _local(11))
            torch.testing.assert_close(inspect(again, gpus=r), _local(11))
            torch.testing.assert_close(inspect(from_seed, gpus=r), _local(100 + r))
            assert not torch.equal(inspect(second, gpus=r), _local(11))


def test_log_remote_reaches_every_rank(mesh, capfd):
    with mesh.activate():
        set_logging_level_remote(logging.INFO)
        log_remote("step %d of %s", 3, "training", level=logging.WARNING)
        inspect(torch.ones(1), gpus=0)  # (the batch above has run)
    deadline = time.monotonic() + 30
    seen = ""
    while time.monotonic() < deadline and seen.count("step 3 of training") < 2:
        time.sleep(0.1)
        got = capfd.readouterr()
        seen += got.err + got.out
    assert seen.count("step 3 of training") >= 2, seen


def _checkpointed_dropout():
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x = torch.ones(64, requires_grad=True)
    y = checkpoint(lambda t: F.dropout(t, 0.5, training=True) * 3.0, x, use_reentrant=False)
    y.sum().backward()
    return y.detach(), x.grad


def test_generator_state_saved_and_restored_inside_activate_is_the_workers(mesh):
    # torch.get_rng_state()/set_rng_state() (and torch.random's, fork_rng's) acted on the controller only:
    # checkpoint's recompute drew another dropout mask on the workers, and the gradients were silently wrong.
    with no_mesh():
        want_y, want_grad = _checkpointed_dropout()
    with mesh.activate():
        y, grad = _checkpointed_dropout()
        assert torch.equal(inspect(y), want_y) and torch.equal(inspect(grad), want_grad)
        torch.random.manual_seed(5)  # torch.random's own name seeds the workers too
        a = torch.rand(3)
        saved = torch.get_rng_state()
        b = torch.rand(3)
        torch.set_rng_state(saved)
        c = torch.rand(3)
        with torch.random.fork_rng():
            torch.rand(5)
        d = torch.rand(3)
        torch.set_rng_state(saved)
        e = torch.rand(6)
    with no_mesh():
        torch.manual_seed(5)
        want_a, want_b = torch.rand(3), torch.rand(3)
    assert torch.equal(inspect(a), want_a) and torch.equal(inspect(b), want_b)
    assert torch.equal(inspect(c), want_b)  # replayed
    assert torch.equal(torch.cat([inspect(c), inspect(d)]), inspect(e))  # fork_rng restored it
