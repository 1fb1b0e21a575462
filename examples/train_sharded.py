"""A small GPT trained with sharded parameters: FSDP on {"dp": 2}, then dp x tp on {"dp": 2, "tp": 2}.

    python examples/train_sharded.py            # STEPS steps
    python examples/train_sharded.py --steps 2  # fewer

The seed's training step, made runnable: `module_to_mesh(model, mesh)` turns the
parameters into global sharded tensors, and the loop is the ordinary one
(forward, `loss.backward()`, `torch.optim.AdamW`). FSDP: each rank feeds its own
half of the batch (a plain mesh tensor) and each block all-gathers its parameters
just before its forward, as FSDP2 does. dp x tp: the batch is a global DTensor and
torch's sharding propagation on the workers does the collectives. The same model (same seed) is first trained
locally on the same batches; each sharded run prints its loss next to the local
one and the script fails if they differ.
"""

import math
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from monarch_tensor import Replicate, Shard, distribute, fetch_shard, module_to_mesh, this_host

# -----------------------------------------------------------------------------
VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 64, 16, 2, 4, 32
BATCH = 8             # sequences per step (split over "dp")
STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 4
LR = 3e-3
TP_PLAN = {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.proj": "rowwise",
           "*.mlp.fc": "colwise", "*.mlp.proj": "rowwise"}
RTOL = 1e-4           # sharded loss vs local loss
# -----------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(N_EMBD, N_EMBD) for _ in range(3))
        self.proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x, mask):
        B, T, C = x.shape
        hs = C // N_HEAD
        q, k, v = (f(x).view(B, T, N_HEAD, hs).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = torch.softmax(att + mask[:T, :T], dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(N_EMBD, 4 * N_EMBD), nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, N_EMBD), nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f, self.head = nn.LayerNorm(N_EMBD), nn.Linear(N_EMBD, VOCAB)
        # additive causal mask: 0 on and below the diagonal, -inf above
        self.register_buffer("mask", torch.full((BLOCK, BLOCK), float("-inf")).triu(1))

    def forward(self, idx, pos, targets):
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x, self.mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def batches():
    """Deterministic synthetic text: each sequence counts up from a random start (mod VOCAB)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        seq = (start + torch.arange(BLOCK + 1)) % VOCAB
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def mesh_loss(loss) -> float:
    """A mesh loss as a Python float: global (a DTensor), or each rank's of its own batch (their mean)."""
    if loss.is_distributed:
        return loss.full_tensor().item()
    return fetch_shard(loss.reduce("dp", "avg")).result().item()


def train(model, to_mesh=None):
    """STEPS AdamW steps; the loss of each (a Python float)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pos = torch.arange(BLOCK)
    losses = []
    for x, y in batches():
        if to_mesh is not None:
            x, y, p = to_mesh(x), to_mesh(y), to_mesh(pos, batch=False)
        else:
            p = pos
        opt.zero_grad()
        loss = model(x, p, y)
        loss.backward()
        opt.step()
        losses.append(loss.item() if to_mesh is None else mesh_loss(loss))
    return losses


def main():
    torch.manual_seed(0)
    init = GPT().state_dict()
    local = GPT()
    local.load_state_dict(init)
    t = time.monotonic()
    ref = train(local)
    print(f"local:      losses {['%.4f' % v for v in ref]}  ({time.monotonic() - t:.2f} s)")

    procs = this_host().spawn_procs({"dp": 2, "tp": 2})
    runs = [("fsdp  dp=2", procs.slice(tp=0), None), ("dp=2 x tp=2", procs, TP_PLAN)]
    for name, mesh, plan in runs:
        model = GPT()
        model.load_state_dict(init)
        module_to_mesh(model, mesh, plan=plan)

        def to_mesh(t, batch=True, mesh=mesh, plain=plan is None):  # batches split over "dp", replicated over "tp"
            places = {"dp": Shard(0)} if batch else {}
            dt = distribute(t, mesh, {**{n: Replicate() for n in mesh._shape.names}, **places})
            return dt.to_local() if plain else dt  # FSDP: each rank its own part, a plain mesh tensor

        t = time.monotonic()
        losses = train(model, to_mesh)
        print(f"{name}: losses {['%.4f' % v for v in losses]}  ({time.monotonic() - t:.2f} s)")
        for step, (a, b) in enumerate(zip(losses, ref)):
            if not math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-5):
                raise SystemExit(f"{name}: step {step} loss {a} differs from local {b}")
    print("sharded losses match local training")
    procs.stop().get(timeout=60)


if __name__ == "__main__":
    main()
