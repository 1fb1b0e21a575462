"""A torchrun-style training script for tests/test_env.py's SPMDActor test: everything from the environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...) and ``sys.argv``, as under torchrun."""

import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out_dir, tag = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"{tag}-rank{os.environ['RANK']}"), "w") as f:
        f.write(f"{t.item()} {os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {sys.argv[0]}")
    dist.destroy_process_group()
