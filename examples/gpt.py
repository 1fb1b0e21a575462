"""A small GPT-style character language model and its data helpers, shared by the examples and benches.

    from gpt import GPT, GPTConfig, CharTokenizer, load_corpus, batch_offsets, get_batch

    text = load_corpus()                                # examples/data/fables.txt
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text))
    model = GPT(GPTConfig(vocab_size=tok.vocab_size))
    offs = batch_offsets(len(data), model.config.block_size, batch_size=8, generator=torch.Generator().manual_seed(0))
    x, y = get_batch(data, offs, model.config.block_size)
    logits, loss = model(x, y)

nanoGPT's model (karpathy/nanoGPT, model.py) cut to what a CPU needs: pre-norm transformer blocks,
causal self-attention written out with plain ops (a mask buffer, softmax, matmuls), GELU MLP, tied
input/output embeddings, no dropout and no bias options. Plain torch only, so the same module runs
eagerly on a laptop and, unchanged, on mesh tensors recorded by the tensor engine: the forward uses
no factory function (positions and the causal mask are buffers made in ``__init__``), no ``.item()``
and no data-dependent shapes. The default config has about 230 K parameters (60-character vocabulary); a
training step on a batch of 8 x 32 characters takes about 10 ms on one CPU core.

The batch helpers index the whole corpus with a tensor of start offsets, so the offsets can be made
on the controller with a seeded generator and the same batches rebuilt anywhere (a rank of a mesh,
a local reference run) from the same numbers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "fables.txt")


# ---- data ---------------------------------------------------------------------------------------
def load_corpus(path: str = DEFAULT_CORPUS) -> str:
    """The text of a corpus file (UTF-8).

        text = load_corpus()            # the fables shipped in examples/data
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if len(text) < 2:
        raise ValueError(f"corpus {path!r} has {len(text)} characters; a language model needs at least 2")
    return text


class CharTokenizer:
    """One token per distinct character of a text, ids in sorted character order.

        tok = CharTokenizer("hello")
        tok.encode("hole")            # [1, 3, 2, 0]
        tok.decode([1, 0, 2, 2, 3])   # 'hello'
    """

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        if not self.chars:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary from")
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        try:
            return [self.stoi[c] for c in s]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary "
                             f"({self.vocab_size} characters)") from None

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return "".join(self.chars[i] for i in ids)


def batch_offsets(n_tokens: int, block_size: int, batch_size: int, generator: torch.Generator,
                  shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Random start offsets of training windows: int64 tensor of ``shape + (batch_size,)``.

    A window starting at ``o`` reads tokens ``o .. o + block_size`` (inputs and shifted targets), so
    offsets lie in ``[0, n_tokens - block_size - 1]``.

        offs = batch_offsets(len(data), 64, 16, torch.Generator().manual_seed(0), shape=(2,))  # 2 ranks
    """
    high = n_tokens - block_size
    if high < 1:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for windows of {block_size} + 1 tokens")
    return torch.randint(0, high, (*shape, batch_size), generator=generator, dtype=torch.int64)


def get_batch(data: torch.Tensor, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``(B, block_size)`` read from ``data`` at ``offsets`` ``(B,)``.

    Only tensor indexing, so it works the same on local tensors and on mesh tensors (where each rank
    may hold different offsets).

        x, y = get_batch(data, torch.tensor([0, 100]), block_size=8)   # y[:, i] == x[:, i + 1]
    """
    window = torch.arange(block_size + 1, dtype=torch.int64)
    if offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D (batch,), got shape {tuple(offsets.shape)}")
    idx = offsets.unsqueeze(1) + window.unsqueeze(0)  # (B, T + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


# ---- model --------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    """Sizes of a :class:`GPT`; the defaults make about 230 K parameters for a 60-character vocabulary.

        cfg = GPTConfig(vocab_size=65, n_layer=4, n_embd=128)
    """

    vocab_size: int = 64
    block_size: int = 32  # longest context
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 96

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, k) < 1:
                raise ValueError(f"GPTConfig.{k} must be >= 1, got {getattr(self, k)}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        # additive causal mask: 0 on and below the diagonal, -inf above
        mask = torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att + self.mask[:T, :T], dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer over token ids; ``forward(idx, targets)`` -> ``(logits, loss)``.

        model = GPT(GPTConfig(vocab_size=tok.vocab_size))
        logits, loss = model(x, y)        # x, y: int64 (B, T) with T <= block_size; loss None without y
        loss.backward()
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings (nanoGPT)
        self.register_buffer("pos", torch.arange(cfg.block_size, dtype=torch.int64), persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
        x = self.wte(idx) + self.wpe(self.pos[:T])
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T); local tensors only (uses multinomial).

            out = model.generate(torch.tensor([tok.encode("The ")]), 100, generator=torch.Generator().manual_seed(0))
        """
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
