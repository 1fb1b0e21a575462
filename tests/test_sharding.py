"""``module_to_mesh``: shared parameters stay shared; training matches local torch.

One proc mesh {"dp": 2} is shared by the module. Every run is compared with
the same model trained by local torch on the same batches (3 AdamW steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from monarch_tensor import Replicate, Shard, distribute, fetch_shard, module_to_mesh, this_host

pytestmark = pytest.mark.timeout(120)
T = 60
VOCAB, BLOCK, EMBD, BATCH = 15, 8, 8, 4  # (VOCAB odd: the embedding's shards are uneven)


@pytest.fixture(scope="module")
def dp2():
    procs = this_host().spawn_procs({"dp": 2})
    yield procs
    procs.stop().get(timeout=T)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(EMBD), nn.Linear(EMBD, 2 * EMBD), nn.Linear(2 * EMBD, EMBD)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    """A GPT-ish model whose ``head.weight is wte.weight`` (tied embeddings); ``scale`` (1 element) is too small
    to shard over dp, so it is replicated."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(EMBD), nn.Linear(EMBD, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("pos", torch.arange(BLOCK))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(self.pos[: idx.shape[1]])
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x) * self.scale)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        seq = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(BLOCK + 1)) % VOCAB
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _train(model, batches, place=lambda t: t, value=lambda loss: loss.item(), opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = model(place(x), place(y))
        loss.backward()
        opt.step()
        losses.append(value(loss))
    return losses


def _global_batch(mesh):
    return lambda t: distribute(t, mesh, {"dp": Shard(0)})


def test_tied_embeddings_stay_one_parameter_and_train_as_local(dp2):
    torch.manual_seed(0)
    ref = TinyGPT()
    model = module_to_mesh(copy.deepcopy(ref), dp2)
    assert model.head.weight is model.wte.weight
    assert len(list(model.parameters())) == len(list(ref.parameters())) == 17  # (head.weight is wte.weight)
    batches = _batches()
    want = _train(ref, batches)
    got = _train(model, batches, _global_batch(dp2), lambda loss: loss.full_tensor().item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.wte.weight.full_tensor(), ref.wte.weight.detach(), rtol=1e-4, atol=1e-5)


def _local_batch(mesh):
    """Each rank's own half of the batch, as a plain mesh tensor (what FSDP2 takes)."""
    return lambda t: distribute(t, mesh, {"dp": Shard(0)}).to_local()


def _mean_loss(loss):
    assert not loss.is_distributed  # (each rank's loss of its own batch, as FSDP2's)
    return fetch_shard(loss.float().reduce("dp", "avg")).result().item()


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_plain_compute_matches_local(dp2, reshard):
    """Per-rank batches: each unit all-gathers its parameters into plain tensors, gradients are reduce-scattered;
    parameters, gradients and AdamW's state stay Shard(0) DTensors at rest. Tied weights included."""
    torch.manual_seed(0)
    ref = TinyGPT()
    units = None if reshard else ["blocks.*"]  # (the default units, named)
    model = module_to_mesh(copy.deepcopy(ref), dp2, reshard_after_forward=reshard, units=units)
    assert model.head.weight is model.wte.weight
    batches = _batches()
    want = _train(ref, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = _train(model, batches, _local_batch(dp2), _mean_loss, opt)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[name].detach(), rtol=1e-4, atol=1e-5)
    w = model.blocks[0].fc.weight
    assert w.placements == (Shard(0),) and w.grad.placements == (Shard(0),)
    assert opt.state[w]["exp_avg"].placements == (Shard(0),)
    assert model.wte.weight.grad.placements == (Shard(0),) and model.scale.grad.placements == (Replicate(),)
    assert model.ln_f.bias.shape == (EMBD,) and model.pos.is_distributed is False  # buffers: plain, as FSDP2's


def test_tp_plan_units_gather_dtensors_and_reduce_gradients_per_unit(dp2):
    """With a plan, each unit gathers its parameters over dp into DTensors (replicated over dp) and its backward
    reduces the unit's gradients in one instruction into the parameters' placements; training (global DTensor
    inputs, uneven shards, tied weights) matches local torch's, and the optimizer's state keeps the placements.
    (The mesh {"dp": 2, "tp": 1} is dp2's procs; tests/test_dtensor_examples.py trains on tp=2.)"""
    torch.manual_seed(0)
    ref = TinyGPT()
    mesh = dp2.split(dp=("dp", "tp"), tp=1)
    model = copy.deepcopy(ref)
    seen = {}
    fc, proj = model.blocks[0].fc, model.blocks[0].proj

    def grad_of_fc_input(mod, args):  # registered first: sees fc's input as the model made it
        args[0].register_hook(lambda g: seen.update(fc_in_grad=g))

    fc.register_forward_pre_hook(grad_of_fc_input)
    model = module_to_mesh(model, mesh, plan={"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"})
    fc.register_forward_pre_hook(lambda mod, args: seen.update(fc_in=args[0]))  # (after module_to_mesh's own)
    proj.register_forward_hook(lambda mod, args, out: seen.update(proj_out=out))

    def grad_of_proj_input(mod, args):  # registered after module_to_mesh's hooks: sees the grad they hand on
        args[0].register_hook(lambda g: seen.update(proj_in_grad=g))

    proj.register_forward_pre_hook(grad_of_proj_input)
    before = _prefetch_stats(dp2)
    batches = _batches()
    want = _train(ref, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = _train(model, batches, lambda t: distribute(t, mesh, {"dp": Shard(0)}),
                 lambda loss: loss.full_tensor().item(), opt)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[name].detach(), rtol=1e-4, atol=1e-5)
    after = _prefetch_stats(dp2)
    units = 3  # (two blocks and the root)
    assert all(a["dist_gathers"] - b["dist_gathers"] == a["dist_reduces"] - b["dist_reduces"] == 3 * units
               for a, b in zip(after, before)), (before, after)
    # torch's ColwiseParallel / RowwiseParallel layouts: whole activations between the tensor-parallel Linears,
    # and whole gradients of them in the backward (the matmuls' Partial sums all-reduced at the boundary)
    assert seen["fc_in"].placements == seen["proj_out"].placements == (Shard(0), Replicate())
    assert seen["fc_in_grad"].placements == seen["proj_in_grad"].placements == (Shard(0), Replicate())
    assert fc.weight.placements == fc.weight.grad.placements == (Replicate(), Shard(0))
    assert proj.weight.grad.placements == (Replicate(), Shard(1)) and proj.bias.grad.placements == (Replicate(),) * 2
    assert model.wte.weight.grad.placements == (Shard(0), Replicate())  # (15 rows over 2 ranks: uneven)
    assert opt.state[fc.weight]["exp_avg"].placements == (Replicate(), Shard(0))


def test_fsdp_mixed_precision_bf16(dp2):
    """FSDP2's MixedPrecisionPolicy: parameters gathered (and the forward run) in bf16, gradients reduced in
    float32 into float32 sharded gradients; the losses stay within bf16's precision of local float32 training."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    ref = TinyGPT()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = module_to_mesh(copy.deepcopy(ref), dp2, mp_policy=policy)
    batches = _batches()
    want = _train(ref, batches)
    losses = []

    def value(loss):
        assert loss.dtype == torch.bfloat16
        losses.append(loss)
        return _mean_loss(loss)

    got = _train(model, batches, _local_batch(dp2), value)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert model.wte.weight.dtype == torch.float32 == model.wte.weight.grad.dtype


def test_fsdp_refuses_what_it_cannot_honour(dp2):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from monarch_tensor import ShardingError

    x, y = _batches(1)[0]
    model = module_to_mesh(TinyGPT(), dp2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ShardingError, match="mp_policy applies to plain"):
        model(_global_batch(dp2)(x), _global_batch(dp2)(y))
    planned = module_to_mesh(TinyGPT(tied=False), dp2, plan={"blocks.*.fc": "colwise"}, tp_dim="dp")
    with pytest.raises(ShardingError, match="tensor parallelism on DTensors"):
        planned(_local_batch(dp2)(x), _local_batch(dp2)(y))
    with pytest.raises(ShardingError, match="units \\['nope'\\] match no submodule"):
        module_to_mesh(TinyGPT(), dp2, units=["nope"])
    with pytest.raises(ShardingError, match="run no forward; name their elements instead \\(e.g. 'blocks.\\*'\\)"):
        module_to_mesh(TinyGPT(), dp2, units=["blocks"])


def _prefetch_stats(mesh) -> dict:
    def read():
        from monarch_tensor.worker import fsdp

        return dict(fsdp.stats)

    return list(mesh.execute(read).values())


def test_fsdp_prefetches_the_next_units_gather_and_never_hands_out_stale_values(dp2):
    """From the second forward on, each unit's gather starts the next one's (FSDP2's forward prefetch), and in
    the backward each regather the one before it (its backward prefetch). A
    prefetch is dropped, and the gather done afresh, where its parameters were written in place after it read
    them (here by a hook between two blocks' forwards), or where no unit took it (a forward that stopped early):
    the training still matches local torch's."""
    torch.manual_seed(0)
    ref = TinyGPT(tied=False)
    model = module_to_mesh(copy.deepcopy(ref), dp2)
    before = _prefetch_stats(dp2)
    batches = _batches(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = _train(ref, batches[:2], opt=ref_opt)
    got = _train(model, batches[:2], _local_batch(dp2), _mean_loss, opt)
    mid = _prefetch_stats(dp2)
    assert all(m["prefetched"] > b["prefetched"] for m, b in zip(mid, before)), (before, mid)
    # and in the backward, each block's regather started the one before it (FSDP2's backward prefetch)
    assert all(m["regathers_prefetched"] > b["regathers_prefetched"] for m, b in zip(mid, before)), (before, mid)

    def scale_next(mod, *_):  # after block 0, which prefetched block 1's gather: block 1's weight changes
        with torch.no_grad():
            (model if mod is model.blocks[0] else ref).blocks[1].fc.weight.mul_(2)

    hooks = [m.blocks[0].register_forward_hook(scale_next) for m in (model, ref)]
    want += _train(ref, batches[2:3], opt=ref_opt)
    got += _train(model, batches[2:3], _local_batch(dp2), _mean_loss, opt)
    for h in hooks:
        h.remove()

    def fail(*_):
        raise RuntimeError("stop here")

    hook = model.blocks[0].fc.register_forward_hook(fail)  # block 0 ran its gather and prefetched block 1's
    x, y = batches[3]
    with pytest.raises(RuntimeError, match="stop here"):
        model(_local_batch(dp2)(x), _local_batch(dp2)(y))
    hook.remove()
    want += _train(ref, batches[3:], opt=ref_opt)
    got += _train(model, batches[3:], _local_batch(dp2), _mean_loss, opt)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    after = _prefetch_stats(dp2)
    assert all(a["stale"] >= m["stale"] + 2 for a, m in zip(after, mid)), (mid, after)


def test_tp_plan_boundaries_take_non_contiguous_inputs(dp2):
    """A colwise Linear fed a transposed (non-contiguous) global tensor: its replicated input is contiguous, as
    the controller records it, so the views that follow work, and the gradients match local torch's."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)

        def forward(self, x):
            h = self.fc(x.transpose(1, 2)).relu()
            return self.proj(h).transpose(1, 2).reshape(-1).sum()

    torch.manual_seed(0)
    ref, x = M(), torch.randn(4, 6, 5)
    mesh = dp2.split(dp=("dp", "tp"), tp=1)
    model = module_to_mesh(copy.deepcopy(ref), mesh, plan={"fc": "colwise", "proj": "rowwise"})
    loss = model(distribute(x, mesh, {"dp": Shard(0)}))
    loss.backward()
    want = ref(x)
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-5)
