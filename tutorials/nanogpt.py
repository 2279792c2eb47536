"""A small GPT (nanoGPT's shape, written plainly) and a packaged character-level corpus.

Shared by tutorials/05_train.py and bench/train_step.py so the benchmark trains exactly the
tutorial's model.  Plain torch: nothing here knows about tdmesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be
on his first entering a neighbourhood, this truth is so well fixed in the minds of the
surrounding families, that he is considered the rightful property of some one or other of
their daughters. My dear Mr. Bennet, said his lady to him one day, have you heard that
Netherfield Park is let at last? Mr. Bennet replied that he had not. But it is, returned she;
for Mrs. Long has just been here, and she told me all about it. Mr. Bennet made no answer.
Do you not want to know who has taken it? cried his wife impatiently. You want to tell me,
and I have no objection to hearing it. This was invitation enough.
"""


def encode(text: str = CORPUS) -> tuple[list[int], list[str]]:
    """The corpus as character ids (a list: make the tensor where it should live), and the vocabulary."""
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return [index[c] for c in text], vocab


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32

    @staticmethod
    def tiny(vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size)

    @staticmethod
    def small(vocab_size: int) -> GPTConfig:
        """nanoGPT's Shakespeare-char size: 6 layers, 6 heads, 384 wide, context 256."""
        return GPTConfig(vocab_size=vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384)

    @staticmethod
    def gpt2() -> GPTConfig:
        """GPT-2 124M's shape: 12 layers, 12 heads, 768 wide, its vocabulary (padded to 50,304
        as nanoGPT does), context 512."""
        return GPTConfig(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768)


SIZES = ("tiny", "small", "gpt2")


def sized(size: str) -> tuple[GPTConfig, list[int]]:
    """The config of a named size and its token stream.  tiny and small train on the
    packaged corpus; gpt2's context and vocabulary outgrow it, so it gets a stream of
    seeded random tokens (the same on every process that asks: the timing is GPT-2's, the
    loss stays near ln(vocab))."""
    if size == "gpt2":
        cfg = GPTConfig.gpt2()
        g = torch.Generator().manual_seed(0)
        return cfg, torch.randint(cfg.vocab_size, (64 * cfg.block_size,), generator=g).tolist()
    tokens, vocab = encode()
    return (GPTConfig.small(len(vocab)) if size == "small" else GPTConfig.tiny(len(vocab))), tokens


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 if p.shape[0] != cfg.vocab_size else 2))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None):
    """Random windows of ``data``: inputs and the next characters."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator, device=data.device)
    offsets = torch.arange(block_size + 1, device=data.device)
    windows = data[starts[:, None] + offsets[None, :]]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
