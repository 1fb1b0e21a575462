"""Launch once, iterate in under a second: the seeds' Studio 1-3 flow on a local mesh.

    python examples/iterate_and_debug.py          # in a terminal: the monarch_dbg> prompt opens at the end
    python examples/iterate_and_debug.py < /dev/null   # non-interactive: the script inspects the breakpoint itself

1. A TorchTitan-style trainer (a job config in TOML, the project's small GPT, examples/gpt.py, torch.distributed
   with gloo, gradients all-reduced) lives in a workspace dir, synced to the procs' workspace
   roots and run by a TrainerActor on 4 procs.
2. The config is edited (learning rate, steps) and synced; the same procs run again at once.
3. The training code is edited (gradient clipping): auto_reload re-imports it in the procs, the
   existing actors run the new code.
4. Environment inspection across ranks (MASTER_*, a mismatched NCCL_* variable).
5. A breakpoint() is added to the training loop on rank 0 and synced; the run pauses there and
   is inspected: at the monarch_dbg> prompt (or `monarch-tensor debug` from another terminal),
   or, without a terminal, by this script through the debug controller.
"""

import os
import shutil
import sys
import tempfile
import threading
import time

import torch  # (imported by the script, torch and torch._dynamo are in the procs from their start)

from monarch_tensor import Workspace
from monarch_tensor.actor import Actor, current_rank, endpoint, this_host
from monarch_tensor.utils import setup_env_for_distributed

# ---- settings ------------------------------------------------------------------------------
GPUS = 4
CONFIG = """[job]
description = "debug model"

[model]
n_layer = 2
n_head = 4
n_embd = 48
block_size = 32

[training]
lr = {lr}
steps = {steps}
batch_size = 4
seed = 0
"""
TRAIN = '''"""A TorchTitan-style training loop: job config from TOML, torch.distributed from the environment."""
import tomllib

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, CharTokenizer, batch_offsets, get_batch, load_corpus


def load_config(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


def build(cfg):
    """The model and the tokenized corpus (the project's small GPT, synced with the workspace)."""
    text = load_corpus()
    tok = CharTokenizer(text)
    torch.manual_seed(cfg["training"]["seed"])
    return GPT(GPTConfig(vocab_size=tok.vocab_size, **cfg["model"])), torch.tensor(tok.encode(text))


def train(cfg, model, data, rank):
    """Run cfg's steps; gradients are averaged over the process group. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["training"]["lr"])
    losses = []
    for step in range(cfg["training"]["steps"]):
        g = torch.Generator().manual_seed(cfg["training"]["seed"] + 1000 * step + rank)
        offs = batch_offsets(len(data), model.config.block_size, cfg["training"]["batch_size"], g)
        x, y = get_batch(data, offs, model.config.block_size)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])  # one bucket, one collective per step (like DDP)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        torch.nn.utils.vector_to_parameters(flat, grads)
        opt.step()
        losses.append(loss.item())
    return losses
'''


class TrainerActor(Actor):
    """Wraps the training loop of the synced workspace; the model lives across runs."""

    def __init__(self):
        import torch.distributed as dist

        torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1: several procs share the cores
        dist.init_process_group("gloo")  # MASTER_ADDR, RANK ... set by setup_env_for_distributed
        self.rank = current_rank().rank
        self.model = None

    @endpoint
    def run(self, config_rel: str) -> list:
        from titan_lite import train

        cfg = train.load_config(os.path.join(os.environ["WORKSPACE_DIR"], "titan_ws", config_rel))
        if self.model is None:
            self.model, self.data = train.build(cfg)
        return train.train(cfg, self.model, self.data, self.rank)


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def inspect_breakpoint_without_terminal() -> None:
    """What a person would type at monarch_dbg>, done through the debug controller."""
    from monarch_tensor.debugger import controller

    ctl = controller()
    deadline = time.monotonic() + 60
    while not ctl.paused() and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in ctl.paused():
        print(f"paused: {s.actor} rank {s.rank} at {os.path.basename(s.filename)}:{s.lineno} in {s.function}")
        ctl.read(s)
        ctl.send(s, "p step, round(loss.item(), 3)")
        print(f"  (Pdb) p step, round(loss.item(), 3) -> {ctl.read(s).replace('(Pdb) ', '').strip()}")
        ctl.send(s, "c")
        ctl.read(s)
    print("continued")


def main() -> None:
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="iterate-")
    src = os.path.join(tmp, "titan_ws")
    write(os.path.join(src, "titan_lite", "__init__.py"), "")
    write(os.path.join(src, "titan_lite", "train.py"), TRAIN)
    write(os.path.join(src, "train_configs", "debug_model.toml"), CONFIG.format(lr=0.0003, steps=10))
    here = os.path.dirname(os.path.abspath(__file__))  # the project's GPT and its corpus travel with the workspace
    shutil.copy(os.path.join(here, "gpt.py"), os.path.join(src, "gpt.py"))
    shutil.copytree(os.path.join(here, "data"), os.path.join(src, "data"))
    ws = Workspace(dirs=[src])

    # Studio 1: launch once.
    procs = this_host().spawn_procs(per_host={"gpus": GPUS})
    setup_env_for_distributed(procs)
    res = procs.sync_workspace(ws, auto_reload=True).get(timeout=120)
    print(f"first sync: {res.files_sent} files to {len(res.roots)} root(s) in {res.seconds * 1e3:.0f} ms")
    trainer = procs.spawn("trainer", TrainerActor)
    losses = trainer.run.call("train_configs/debug_model.toml").get(timeout=300).values()
    print(f"run 1 (lr 3e-4, 10 steps): loss {losses[0][0]:.3f} -> {losses[0][-1]:.3f}")

    # Studio 2: change the config, sync, run again on the same procs.
    t = time.perf_counter()
    write(os.path.join(src, "train_configs", "debug_model.toml"), CONFIG.format(lr=0.01, steps=8))
    res = procs.sync_workspace(ws, auto_reload=True).get(timeout=120)
    losses = trainer.run.call("train_configs/debug_model.toml").get(timeout=300).values()
    dt = time.perf_counter() - t
    print(f"config synced ({', '.join(res.changed)}) in {res.seconds * 1e3:.0f} ms")
    print(f"run 2 (lr 1e-2, 8 steps): loss {losses[0][0]:.3f} -> {losses[0][-1]:.3f}; "
          f"edit + sync + run in {dt:.2f} s on the same procs")

    # Code change: hot reload into the running actors.
    code = TRAIN.replace("        opt.step()", "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                         "        opt.step()")
    code = code.replace("    losses = []\n", "    losses = []\n    if rank == 0:\n"
                        "        print('titan_lite: clipping gradients at 1.0', flush=True)\n")
    write(os.path.join(src, "titan_lite", "train.py"), code)
    res = procs.sync_workspace(ws, auto_reload=True).get(timeout=120)
    print(f"code synced; reloaded on every rank: {sorted(set(m for r in res.reloaded.values() for m in r))}")
    losses = trainer.run.call("train_configs/debug_model.toml").get(timeout=300).values()
    print(f"run 3 (new code, clipped gradients): loss {losses[0][-1]:.3f}")

    # Studio 3: environment inspection.
    env = procs.env.list("MASTER_").get(timeout=30).item(gpus=0)
    print(f"env on rank 0: MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}")
    print("RANK per rank:", procs.env.get("RANK").get(timeout=30).values())
    procs.env.set("NCCL_SOCKET_IFNAME", "eth0").get(timeout=30)
    procs.env.set("NCCL_SOCKET_IFNAME", {3: "eth1"}).get(timeout=30)
    print("mismatches:", procs.env.mismatches("NCCL_").get(timeout=30))

    # Studio 3: a breakpoint in the training loop, rank 0, step 2.
    code = code.replace("        losses.append(loss.item())\n",
                        "        losses.append(loss.item())\n"
                        "        if rank == 0 and step == 2:\n            breakpoint()\n")
    write(os.path.join(src, "titan_lite", "train.py"), code)
    procs.sync_workspace(ws, auto_reload=True).get(timeout=120)
    pending = trainer.run.call("train_configs/debug_model.toml")
    if not sys.stdin.isatty():
        threading.Thread(target=inspect_breakpoint_without_terminal, daemon=True).start()
    losses = pending.get(timeout=600).values()
    print(f"run 4 finished after the breakpoint: loss {losses[0][-1]:.3f}")
    procs.stop()
    print(f"done in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
