"""Op chains for the sharded-tensor tests: the same code runs on DTensors, mesh tensors and local tensors."""

from __future__ import annotations

import torch


def _apply(op: str, x: torch.Tensor) -> torch.Tensor:
    if op == "add1":
        return x + 1
    if op == "mul_self":
        return x * x
    if op == "tanh":
        return torch.tanh(x)
    if op == "relu":
        return torch.relu(x)
    if op == "neg_exp":
        return torch.exp(-x.abs())
    if op == "t":
        return x.t()
    if op == "mm_t":
        return x @ x.t()
    if op == "t_mm":
        return x.t() @ x
    if op == "sum0":
        return x.sum(0, keepdim=True)
    if op == "sum1":
        return x.sum(1, keepdim=True)
    if op == "softmax0":
        return torch.softmax(x, 0)
    if op == "softmax1":
        return torch.softmax(x, 1)
    if op == "scale":
        return x * 0.5 - 0.25
    raise ValueError(op)


OPS = ("add1", "mul_self", "tanh", "relu", "neg_exp", "t", "mm_t", "t_mm", "sum0", "sum1", "softmax0",
       "softmax1", "scale")


def run_chain(x: torch.Tensor, ops) -> torch.Tensor:
    for op in ops:
        x = _apply(op, x)
    return x
