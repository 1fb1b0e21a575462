"""Where the workers of a mesh put tensors on this machine: its GPU where it has one, else the CPU. Tests that
compare with local torch compute the reference there too (CPU and CUDA random streams differ)."""

import torch

WORKER_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
