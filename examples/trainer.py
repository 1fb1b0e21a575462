"""A Trainer actor per proc, each training a small MLP, driven from this script.

    python examples/trainer.py

The seeds' snippet, made runnable:

    training_procs = this_host().spawn_procs({"gpus": 8})
    trainers = training_procs.spawn("trainers", Trainer)
    fut = trainers.train.call(step=0)
    fut.get()

Every rank holds a replica of the same model (same seed) and trains it on its
own shard of a synthetic regression task. Every AVERAGE_EVERY steps the script
gathers the replicas' weights, averages them and sends the average back (model
averaging, a.k.a. local SGD), so the replicas stay in step. One line per step.
"""

import time

import torch

from monarch_tensor.actor import Actor, current_rank, endpoint, this_host

# -----------------------------------------------------------------------------
NUM_GPUS = 4          # trainers (one proc each; "gpus" is a label, no GPU needed)
STEPS = 30            # training steps
AVERAGE_EVERY = 5     # average the replicas' weights every this many steps
BATCH = 64            # samples per step per rank
IN_DIM, HIDDEN = 16, 32
LR = 0.05             # SGD learning rate
TIMEOUT = 60.0        # seconds any single wait may take
# -----------------------------------------------------------------------------


class Trainer(Actor):
    def __init__(self, lr: float):
        torch.set_num_threads(1)  # several procs share this machine's cores
        self.rank = current_rank().rank
        torch.manual_seed(0)  # same initial weights and the same task on every rank
        self.model = torch.nn.Sequential(
            torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
        self.true_w = torch.randn(IN_DIM, 1) / 4  # the function to learn: y = tanh(x @ true_w)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.data = torch.Generator().manual_seed(1000 + self.rank)  # this rank's data shard
        self.loss = float("nan")

    @endpoint
    def train(self, step: int) -> float:
        """One optimizer step on a fresh batch; returns the batch loss."""
        x = torch.randn(BATCH, IN_DIM, generator=self.data)
        y = torch.tanh(x @ self.true_w) + 0.01 * torch.randn(BATCH, 1, generator=self.data)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.loss = loss.item()
        return self.loss

    @endpoint
    def get_loss(self) -> float:
        return self.loss

    @endpoint
    def get_weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @endpoint
    def set_weights(self, weights: dict) -> None:
        self.model.load_state_dict(weights)


t0 = time.monotonic()
training_procs = this_host().spawn_procs({"gpus": NUM_GPUS})
trainers = training_procs.spawn("trainers", Trainer, LR)
trainers.initialized.get(timeout=TIMEOUT)
print(f"{NUM_GPUS} trainers up in {time.monotonic() - t0:.1f} s; training for {STEPS} steps")

for step in range(STEPS):
    t = time.monotonic()
    losses = trainers.train.call(step=step).get(timeout=TIMEOUT).values()
    note = ""
    if (step + 1) % AVERAGE_EVERY == 0:
        replicas = trainers.get_weights.call().get(timeout=TIMEOUT).values()
        average = {k: torch.stack([r[k] for r in replicas]).mean(0) for k in replicas[0]}
        trainers.set_weights.call(average).get(timeout=TIMEOUT)
        note = " | weights averaged"
    mean = sum(losses) / len(losses)
    per_rank = " ".join(f"{v:.4f}" for v in losses)
    print(f"step {step:3d} | loss {mean:.4f} | per rank {per_rank} | {1000 * (time.monotonic() - t):5.1f} ms{note}")

final = trainers.get_loss.call().get(timeout=TIMEOUT)
print("final loss per rank:", ", ".join(f"gpus={p['gpus']}: {v:.4f}" for p, v in final))
training_procs.stop().get(timeout=TIMEOUT)
print(f"done in {time.monotonic() - t0:.1f} s")
