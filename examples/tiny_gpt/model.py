# SPDX-License-Identifier: Apache-2.0
"""A small decoder-only GPT in plain torch: the fork's compute-dominated workload.

GPT-2 layout: token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
self-attention through ``scaled_dot_product_attention``, then a GELU MLP of width 4 * d_model),
a final LayerNorm and an LM head tied to the token embedding. ``GPT(config, seed)`` initialises
its parameters from ``seed`` alone, so every rank builds the same model without touching the
global RNG.

Two sizes, measured on the 2-core development machine (AMD EPYC, torch 2.13 CPU, fp32,
``torch.set_num_threads(1)`` per process, seq_len 128, vocab 256; min of 8 repeats):

``GPTConfig.bench()`` (also the defaults): d_model 128, 4 layers, 4 heads. 0.842 M parameters,
    ``flops_per_sample()`` 0.74 GFLOP (about 25 GFLOP/s achieved on one core).
    forward+backward at micro-batch 4 / 8 / 16: 0.127 / 0.238 / 0.468 s, so
    time = a + b * mbs with a = 12.7 ms and b = 28.4 ms per sample (every point within 1%).
    AdamW step 9.2 ms. All-reduce of the 3.4 MB gradient over 2 gloo ranks: 3.5 ms alone.
    In a 2-rank data-parallel step at micro-batch 8 (fwd+bwd 243 ms, flatten + all-reduce +
    copy back 9.5 ms, AdamW 10.7 ms) forward+backward is 92% of the step; the optimizer and
    communication scale with parameters but compute with tokens, so a larger micro-batch raises
    that share further (a wider model would not).
``GPTConfig.demo()``: d_model 128, 2 layers, 4 heads. 0.446 M parameters, 0.38 GFLOP per sample.
    forward+backward at micro-batch 4 / 8 / 16: 0.066 / 0.124 / 0.244 s (a = 6.0 ms,
    b = 14.8 ms); 2-rank step at micro-batch 8: 0.134 s, 91% forward+backward. 60 AdamW steps
    (lr 1e-3) at a global batch of 16 take the loss from 5.85 to 2.25 nats per byte, below the
    corpus's byte-unigram entropy (3.00), towards its bigram entropy (2.16).

Absolute times are this machine's; re-measure elsewhere.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``vocab_size`` 256 matches the byte-level tokenizer of ``data.py``."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def bench(cls):
        """Benchmark size: forward+backward dominates a data-parallel step (see module docstring)."""
        return cls(seq_len=128, n_layer=4, n_head=4, d_model=128)

    @classmethod
    def demo(cls):
        """Demo size: a 60-step 2-rank run takes seconds and the loss visibly falls."""
        return cls(seq_len=128, n_layer=2, n_head=4, d_model=128)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matmul for queries, keys and values: fewer, larger GEMMs are faster on CPU.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.out_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head)
        query, key, value = heads.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, head, length, head_dim)
        mixed = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        mixed = mixed.transpose(1, 2).reshape(batch, length, width)
        return self.out_dropout(self.out(mixed))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp_in = nn.Linear(config.d_model, 4 * config.d_model)
        self.mlp_out = nn.Linear(4 * config.d_model, config.d_model)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp_dropout(self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x)))))


class GPT(nn.Module):
    """Decoder-only transformer.

    Args:
        config: a :class:`GPTConfig`.
        seed: initialises every parameter (default 0); the global RNG is left as it was.

    ``forward(idx, targets=None)`` takes token ids of shape (batch, length <= seq_len) and returns
    logits (batch, length, vocab_size), or, given targets of the same shape as ``idx``, the mean
    next-token cross-entropy: a scalar, so a DeepSpeed engine's ``engine(idx, targets)`` is the loss.
    """

    def __init__(self, config, seed=0):
        super().__init__()
        self.config = config
        # Module constructors draw their default init from the global RNG; fork it so that building
        # a model has no side effect on the caller's random stream (data order, dropout).
        with torch.random.fork_rng(devices=[]):
            self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
            self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
            self.embed_dropout = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.final_norm = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Tied as in GPT-2: one parameter shared by two modules, the layout ZeRO-3 is tested with.
        self.lm_head.weight = self.token_embedding.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed=0):
        """GPT-2 initialisation from ``seed``: N(0, 0.02) weights, zero biases, unit norms, and the
        projections that write into the residual stream scaled by 1/sqrt(2 * n_layer) so that the
        stream's variance does not grow with depth.

        One departure: the tied token embedding starts at std 0.05. As the LM head it receives a
        gradient on every row at every position, which in the first steps pushes all rows along one
        shared "token frequency" direction; at std 0.02 that swamps what tells the input tokens
        apart, and small-batch runs sit at the unigram loss (3.0 nats here) for 100+ steps. At 0.05
        the demo run leaves the plateau within about 20 steps (measured over 4 seeds)."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():  # shared (tied) weight visited once, in a fixed order
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            elif name == "token_embedding.weight":
                param.normal_(0.0, 0.05, generator=generator)
            elif name.endswith(("attn.out.weight", "mlp_out.weight")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)

    def forward(self, idx, targets=None):
        length = idx.shape[1]
        if length > self.config.seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds seq_len {self.config.seq_len}")
        positions = torch.arange(length, device=idx.device)
        x = self.embed_dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        # The loss in fp32 even when the engine runs the model in bf16/fp16: log-softmax over the
        # vocabulary is where low precision hurts most. reshape, not view: targets are often a
        # shifted (non-contiguous) slice of the same batch as idx.
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self, matmul_only=False):
        """Distinct parameters (the tied embedding counted once). ``matmul_only`` leaves out the
        position embedding, a table lookup that does no multiply-adds; the token embedding stays,
        since as the tied LM head it is a (d_model x vocab) matmul."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.position_embedding.weight.numel() if matmul_only else total

    def flops_per_sample(self, seq_len=None):
        """Approximate training FLOPs (forward + backward) for one sequence of ``seq_len`` tokens
        (default ``config.seq_len``): 6 * N * T for the weight matmuls (2 forward, 4 backward per
        parameter per token, N from ``num_parameters(matmul_only=True)``), plus 12 * n_layer *
        d_model * T^2 for the attention scores and their weighted sum. Causal masking is not
        discounted: the CPU attention kernel computes the full T x T scores."""
        length = seq_len or self.config.seq_len
        attention = 12 * self.config.n_layer * self.config.d_model * length * length
        return 6 * self.num_parameters(matmul_only=True) * length + attention
