"""Reinforcement-learning weight sync: trainers publish weights as RDMABuffers, generators pull them.

    python examples/weight_sync.py
    python examples/weight_sync.py --steps 3 --width 256     # quick (the test runs this)

A trainer actor keeps all its parameters in one flat tensor and registers it
once as an ``RDMABuffer``; the handle travels to the generators in an
ordinary message. After every training step each generator pulls the fresh
weights one-sidedly (the trainer does nothing during the copy) into its own
flat copy and checks a checksum against the trainer's. One line per step:
loss, GiB/s of the pull per generator, and the backend that moved the bytes.
"""

import argparse
import time

import torch
from monarch_tensor.rdma import RDMABuffer

from monarch_tensor.actor import Actor, current_rank, endpoint, this_host

# -----------------------------------------------------------------------------
GENERATORS = 2      # generator procs pulling weights
STEPS = 8           # training steps (one sync after each)
WIDTH = 1024        # hidden width: 4 layers of WIDTH x WIDTH floats, ~16 MiB of weights
BATCH = 32
LR = 1e-3
# -----------------------------------------------------------------------------


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def flatten_into_one_buffer(model: torch.nn.Module) -> torch.Tensor:
    """Move every parameter into views of one flat tensor (so one registration covers them all)."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.data.view(-1))
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat


class Trainer(Actor):
    def __init__(self, width: int):
        self.width = width
        self.model = make_model(width)
        self.flat = flatten_into_one_buffer(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.buf = RDMABuffer(self.flat)

    @endpoint
    def weights(self) -> RDMABuffer:
        return self.buf

    @endpoint
    def step(self) -> float:
        x = torch.randn(BATCH, self.width)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()  # in place: the registered buffer now holds the new weights
        return loss.item()

    @endpoint
    def checksum(self) -> float:
        return float(self.flat.double().sum())


class Generator(Actor):
    def __init__(self, width: int):
        self.width = width
        self.model = make_model(width)
        self.flat = flatten_into_one_buffer(self.model)

    @endpoint
    def pull(self, weights: RDMABuffer) -> tuple[int, float, float, str]:
        t = time.perf_counter()
        weights.read_into(self.flat).get(timeout=60)
        dt = time.perf_counter() - t
        return current_rank().rank, dt, float(self.flat.double().sum()), weights.backend

    @endpoint
    def generate(self, n: int) -> list[float]:
        with torch.no_grad():
            return self.model(torch.ones(1, self.width))[0, :n].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--width", type=int, default=WIDTH)
    args = ap.parse_args()
    trainer_procs = this_host().spawn_procs(per_host={"gpus": 1})
    generator_procs = this_host().spawn_procs(per_host={"gpus": GENERATORS})
    trainer = trainer_procs.spawn("trainer", Trainer, args.width)
    generators = generator_procs.spawn("generators", Generator, args.width)
    weights = trainer.weights.call_one().get()
    nbytes = weights.size()
    print(f"weights: {nbytes / 2**20:.1f} MiB in one RDMABuffer, {GENERATORS} generators pulling")
    in_sync = True
    for step in range(args.steps):
        loss = trainer.step.call_one().get()
        pulls = generators.pull.call(weights).get().values()
        want = trainer.checksum.call_one().get()
        ok = all(abs(s - want) <= 1e-6 * max(1.0, abs(want)) for _, _, s, _ in pulls)
        in_sync &= ok
        rates = "  ".join(f"gen{r}: {nbytes / dt / 2**30:6.2f} GiB/s" for r, dt, _, _ in pulls)
        print(f"step {step}: loss {loss:.4f}  {rates}  backend {pulls[0][3]}  in sync: {ok}")
    outs = generators.generate.call(3).get().values()
    print(f"generators agree: {all(o == outs[0] for o in outs)}")
    print(f"weights in sync after every step: {in_sync}")
    trainer_procs.stop().get()
    generator_procs.stop().get()


if __name__ == "__main__":
    main()
