"""The small GPT and generated corpus behind the benchmark and demo (examples/tiny_gpt)."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

# examples/ is not an installed package; `make test` puts the tree's root on PYTHONPATH, this
# covers a bare `pytest tests/unit/test_tiny_gpt.py`.
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)

from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, build_corpus  # noqa: E402
from examples.tiny_gpt.data import VOCAB_SIZE, decode, encode, split_batch  # noqa: E402


def small_config():
    return GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)


def test_same_seed_same_parameters_and_global_rng_untouched():
    rng_before = torch.get_rng_state()
    first, second = GPT(small_config(), seed=7), GPT(small_config(), seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    other = GPT(small_config(), seed=8)
    assert not torch.equal(first.blocks[0].attn.qkv.weight, other.blocks[0].attn.qkv.weight)


def test_head_is_tied_and_counted_once():
    model = GPT(small_config())
    assert model.lm_head.weight is model.token_embedding.weight
    config = model.config
    d = config.d_model
    per_block = 12 * d * d + 13 * d  # qkv, attention out, MLP in/out with biases, two LayerNorms
    expected = (config.vocab_size + config.seq_len) * d + config.n_layer * per_block + 2 * d
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) == expected
    assert model.num_parameters() - model.num_parameters(matmul_only=True) == config.seq_len * config.d_model


def test_initial_loss_is_near_uniform_and_flops_formula():
    config = small_config()
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    loss = model(idx[:, :-1], idx[:, 1:])
    assert loss.dim() == 0 and abs(loss.item() - math.log(config.vocab_size)) < 0.2
    params, length = model.num_parameters(matmul_only=True), config.seq_len
    assert model.flops_per_sample() == 6 * params * length + 12 * config.n_layer * config.d_model * length**2
    assert model.flops_per_sample(seq_len=16) < model.flops_per_sample()


def test_causal_masking():
    config = small_config()
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    position = 20
    changed[:, position] = (changed[:, position] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert before.shape == (2, config.seq_len, config.vocab_size)
    assert torch.equal(before[:, :position], after[:, :position])
    assert not torch.allclose(before[:, position:], after[:, position:])


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        GPT(small_config())(torch.zeros(1, 33, dtype=torch.long))


def test_corpus_is_reproducible_text():
    corpus = build_corpus()
    assert corpus == build_corpus() and corpus != build_corpus(seed=1)
    assert 200_000 < len(corpus) < 400_000 and corpus.isascii()
    assert decode(encode(corpus[:1000])) == corpus[:1000]


def test_dataset_reproducible_and_shaped():
    dataset = TokenDataset(seq_len=64, num_samples=40, seed=3)
    again, other = TokenDataset(seq_len=64, num_samples=40, seed=3), TokenDataset(seq_len=64, num_samples=40, seed=4)
    assert len(dataset) == 40
    assert all(torch.equal(dataset[i], again[i]) for i in range(len(dataset)))
    assert not all(torch.equal(dataset[i], other[i]) for i in range(len(dataset)))
    item = dataset[0]
    assert item.shape == (65, ) and item.dtype == torch.long and int(item.max()) < VOCAB_SIZE
    batch = next(iter(DataLoader(dataset, batch_size=8)))
    inputs, targets = split_batch(batch)
    assert batch.shape == (8, 65) and inputs.shape == targets.shape == (8, 64)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.fixture
def one_thread():
    # Two intra-op threads on a 2-core machine that is busy with anything else run this test 7x
    # slower than one (measured: 30 s vs 4 s); ranks in the benchmark use one thread each too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_loss_decreases_at_demo_size(one_thread):
    torch.manual_seed(0)
    config = GPTConfig.demo()
    model = GPT(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TokenDataset(config.seq_len, num_samples=20 * 8, seed=0), batch_size=8)
    held_out = split_batch(torch.stack(list(TokenDataset(config.seq_len, num_samples=8, seed=99))))
    with torch.no_grad():
        start = model(*held_out).item()
    for batch in loader:
        loss = model(*split_batch(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        end = model(*held_out).item()
    # From about ln(256) = 5.5 nats to below the corpus's byte unigram entropy (3.0 nats): past
    # letter frequencies, so the model uses the context (the bigram entropy is 2.16).
    assert start > 5.0 and end < 2.9, (start, end)
