"""Built-in small models and training steps: the demo, the benchmarks and the tests use them."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_mlp(width: int = 256, depth: int = 8, classes: int = 10) -> nn.Sequential:
    """The reference MLP: depth × (Linear + GELU), then a classifier."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Block(nn.Module):
    """A small transformer LM: embedding, one pre-norm attention block with GELU MLP, head."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No qkv bias: the key bias gets an exactly-zero gradient, which Adam turns into noise.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


class PreNormBlock(nn.Module):
    """A pre-norm transformer block over ``[batch, seq, d]``: attention, layer norm, GELU MLP,
    residuals — the pipeline stage of the split tests and the job benchmark."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ConvNet(nn.Module):
    """A small CNN with batch norm (running statistics mutate every training step)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


def make_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
              set_to_none: bool = False) -> Callable[..., torch.Tensor]:
    """A whole training step: zero grads (in place, or ``set_to_none``: dropped), forward, loss,
    backward, optimizer update."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def make_lm_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Hugging Face causal-LM training step on token ids (next-token loss over all positions)."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        return loss

    return step


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
