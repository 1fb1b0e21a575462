"""Data-parallel training of a small GPT on a mesh of procs, from one ordinary script.

    python examples/train_ddp.py                        # 2 procs, 200 steps, loss curve in examples/out/
    python examples/train_ddp.py --gpus 4 --steps 50    # any setting below can be given as --name value

The model, the optimizer and the loop are plain PyTorch (examples/gpt.py, torch.optim.AdamW); they
run in this script, on mesh tensors, and the tensor engine executes every op on each proc of the
mesh ("gpus" is just the name of the mesh dimension: on a CPU-only machine every proc computes on
its CPU). What makes it data-parallel:

  * every rank starts from the same weights (``torch.manual_seed`` inside ``activate()`` seeds the
    workers, then the model's initialisation, recorded like any other op, draws the same numbers on
    every rank);
  * every rank holds the whole corpus and reads its own batches: the start offsets of every rank's
    windows are drawn here with a seeded generator, and ``shard_batch(offsets, "gpus")`` gives each
    rank its own BATCH of them (rank r: chunk r);
  * after ``loss.backward()`` the gradients are averaged over the ranks with ``reduce_([p.grad for p in
    model.parameters()], "gpus", "avg")``: one all-reduce of all of them side by side (as DDP's buckets;
    ``p.grad.reduce_("gpus", "avg")`` per parameter works too, one all-reduce each), so AdamW takes the
    same step everywhere and the replicas stay equal.

That is exactly plain training on the union of the ranks' batches, so tests/test_train_ddp.py
checks the losses against ``train_local`` below (the same model trained with local torch on the same
batches). One line per step: a progress bar, the mean loss and each rank's loss, ms per step. At the
end: the loss curve as a PNG (matplotlib if installed, else examples/lineplot.py) and a sample of
text from the trained model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, CharTokenizer, GPTConfig, batch_offsets, get_batch, load_corpus
from lineplot import save_line_plot

# -----------------------------------------------------------------------------
GPUS = 2              # procs in the mesh, one data-parallel rank each
STEPS = 200           # optimizer steps
BATCH = 8             # sequences per rank per step
BLOCK = 32            # characters per sequence (the model's context)
N_LAYER, N_HEAD, N_EMBD = 2, 4, 96
LR = 3e-3             # AdamW
WEIGHT_DECAY = 0.01
SEED = 1337           # weights and batches
THREADS = 0           # torch threads per proc; 0: spawn_procs' default, the host's cores shared out among its procs
SAMPLE_CHARS = 200    # characters sampled from the trained model at the end (0: none)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
TIMEOUT = 120.0       # seconds any single fetch may take
# -----------------------------------------------------------------------------


def settings_from_args(argv=None) -> dict:
    """The settings above, overridden by ``--name value`` on the command line (plus --json PATH)."""
    names = ["GPUS", "STEPS", "BATCH", "BLOCK", "N_LAYER", "N_HEAD", "N_EMBD", "LR", "WEIGHT_DECAY", "SEED",
             "THREADS", "SAMPLE_CHARS", "OUT_DIR", "TIMEOUT"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for n in names:
        v = globals()[n]
        ap.add_argument(f"--{n.lower().replace('_', '-')}", dest=n, type=type(v), default=v)
    ap.add_argument("--json", metavar="PATH", help="also write the settings and every step's losses as JSON")
    args = vars(ap.parse_args(argv))
    for n in ("GPUS", "STEPS", "BATCH", "BLOCK"):
        if args[n] < 1:
            ap.error(f"--{n.lower()} must be >= 1, got {args[n]}")
    if args["THREADS"] < 0:
        ap.error(f"--threads must be >= 0, got {args['THREADS']}")
    return args


def make_run(s: dict):
    """Tokenizer, encoded corpus, model config and every step's batch offsets (STEPS, GPUS, BATCH)."""
    text = load_corpus()
    tok = CharTokenizer(text)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=s["BLOCK"], n_layer=s["N_LAYER"], n_head=s["N_HEAD"],
                    n_embd=s["N_EMBD"])
    gen = torch.Generator().manual_seed(s["SEED"])
    offsets = batch_offsets(len(text), s["BLOCK"], s["BATCH"], gen, shape=(s["STEPS"], s["GPUS"]))
    return tok, tok.encode(text), cfg, offsets


def progress(step: int, steps: int, width: int = 20) -> str:
    done = round(width * (step + 1) / steps)
    return f"[{'#' * done}{'.' * (width - done)}] {step + 1:>{len(str(steps))}}/{steps}"


def train_ddp(s: dict) -> tuple[list[list[float]], dict]:
    """Train on a fresh mesh; returns each step's per-rank losses and the final weights (rank 0's)."""
    from monarch_tensor import fetch_shard, reduce_, shard_batch
    from monarch_tensor.actor import this_host

    tok, ids, cfg, offsets = make_run(s)
    steps, batch = s["STEPS"], s["BATCH"]
    offsets = offsets.tolist()  # plain lists: shipped to the mesh as they are, step by step
    procs = this_host().spawn_procs(per_host={"gpus": s["GPUS"]}, threads=s["THREADS"] or None)
    losses: list[list[float]] = []
    try:
        with procs.activate():
            torch.manual_seed(s["SEED"])  # seeds every rank alike: the same initial weights everywhere
            data = torch.tensor(ids)           # the whole corpus on every rank
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=s["LR"], weight_decay=s["WEIGHT_DECAY"])
            print(f"GPT with {model.num_params():,} parameters on a mesh of {s['GPUS']} procs; "
                  f"{batch} x {cfg.block_size} characters per rank per step", flush=True)
            pending = None  # the previous step's loss fetch: printed once the next step is issued
            t0 = time.perf_counter()
            for step in range(steps + 1):
                if step < steps:
                    mine = shard_batch(torch.tensor(offsets[step]).flatten(), "gpus")  # (BATCH,): rank r's row
                    x, y = get_batch(data, mine, cfg.block_size)
                    _, loss = model(x, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    reduce_([p.grad for p in model.parameters()], "gpus", "avg")  # one all-reduce for all
                    opt.step()
                    per_rank = loss.detach().reduce("gpus", "stack")               # (GPUS,) on every rank
                    fut = fetch_shard(per_rank, gpus=0)
                if pending is not None:
                    got = [float(v) for v in pending.result(timeout=s["TIMEOUT"])]
                    losses.append(got)
                    ms = (time.perf_counter() - t0) * 1e3 / len(losses)
                    print(f"{progress(step - 1, steps)} | loss {sum(got) / len(got):.4f} | per rank "
                          f"{' '.join(f'{v:.4f}' for v in got)} | {ms:.0f} ms/step", flush=True)
                pending = fut if step < steps else None
            weights = fetch_shard(dict(model.state_dict()), gpus=0).result(timeout=s["TIMEOUT"])
    finally:
        procs.stop().get(timeout=s["TIMEOUT"])
    return losses, weights


def train_local(s: dict) -> list[list[float]]:
    """The reference: the same model trained with plain local torch on the same batches.

    Every rank's loss is computed on its batch and their mean is minimised, whose gradient is the
    average of the ranks' gradients: what the all-reduce gives each replica in ``train_ddp``.
    """
    tok, ids, cfg, offsets = make_run(s)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # where the mesh's workers train
        data = torch.tensor(ids)
        torch.manual_seed(s["SEED"])
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=s["LR"], weight_decay=s["WEIGHT_DECAY"])
        losses = []
        for step in range(s["STEPS"]):
            per_rank = [model(*get_batch(data, offsets[step, r].to(data.device), cfg.block_size))[1]
                        for r in range(s["GPUS"])]
            opt.zero_grad(set_to_none=True)
            torch.stack(per_rank).mean().backward()
            opt.step()
            losses.append([v.item() for v in per_rank])
    return losses


def main(argv=None) -> None:
    s = settings_from_args(argv)
    t = time.perf_counter()
    losses, weights = train_ddp(s)
    mean = [sum(r) / len(r) for r in losses]
    os.makedirs(s["OUT_DIR"], exist_ok=True)
    png = os.path.join(s["OUT_DIR"], "train_ddp_loss.png")
    backend = save_line_plot(png, mean, title=f"train loss, {s['GPUS']} ranks", xlabel="step",
                             xs=range(1, len(mean) + 1))
    print(f"loss curve: {png} ({backend})")
    if s["SAMPLE_CHARS"] > 0:  # the trained weights, back in a local model
        tok, _, cfg, _ = make_run(dict(s, STEPS=1))
        model = GPT(cfg)
        model.load_state_dict(weights)
        gen = torch.Generator().manual_seed(s["SEED"])
        out = model.generate(torch.tensor([tok.encode("The ")]), s["SAMPLE_CHARS"], generator=gen)
        print("sample: " + tok.decode(out[0]).replace("\n", " "))
    if s["json"]:
        with open(s["json"], "w") as f:
            json.dump({"settings": {k: v for k, v in s.items() if k != "json"}, "losses": losses}, f)
    print(f"done in {time.perf_counter() - t:.1f} s: loss {mean[0]:.4f} -> {mean[-1]:.4f}")


if __name__ == "__main__":
    main()
