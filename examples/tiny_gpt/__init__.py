# SPDX-License-Identifier: Apache-2.0
"""A small GPT and a generated text corpus: the workload of the fork's benchmark and demo.

    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch

    model = GPT(GPTConfig.demo(), seed=0)
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=4096, seed=0)

See ``model.py`` for the two measured sizes and ``data.py`` for what a batch holds.
"""

from .data import VOCAB_SIZE, TokenDataset, build_corpus, decode, encode, split_batch
from .model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "TokenDataset", "VOCAB_SIZE", "build_corpus", "decode", "encode", "split_batch"]
