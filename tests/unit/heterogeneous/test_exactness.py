# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous training equals single-process training on the global batch.

Two ranks run uneven micro-batches ([5, 3], [7, 1], ...) through ``deepspeed.initialize`` in ZeRO
0-3; after five optimizer steps every parameter must match a plain-torch reference that trains
on the whole global batch in one process. ``strategy: uniform`` must equal upstream bit for bit.
"""

import pytest
import torch

from harness import run_subcases

WIDTH = 16
STEPS = 5
LR = 1e-2


def make_model():
    torch.manual_seed(20261130)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def global_batches(train_batch_size, steps=STEPS):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(train_batch_size, WIDTH, generator=generator),
             torch.randn(train_batch_size, WIDTH, generator=generator)) for _ in range(steps)]


def reference_parameters(train_batch_size, clipping):
    """Single process, whole global batch per step, torch's Adam: what training must produce."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for inputs, targets in global_batches(train_batch_size):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def ds_config(stage, gas, sizes, clipping, strategy="manual"):
    heterogeneous = {"enabled": True, "load_balancing_strategy": strategy}
    if strategy == "manual":
        heterogeneous["micro_batch_sizes"] = sizes
    return {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clipping,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "heterogeneous_config": heterogeneous,
    }


def train_slices(engine, rank, sizes, gas, train_batch_size, dtype=None, first=0, after_step=None):
    """Feed ``engine`` this rank's slice of every global micro-batch (``global_batches``) and step,
    from step ``first`` (0-based) on; ``after_step(n)`` runs after the n-th step (1-based)."""
    offset, per_micro = sum(sizes[:rank]), sum(sizes)
    for step, (inputs, targets) in enumerate(global_batches(train_batch_size)):
        if step < first:
            continue
        for micro in range(gas):
            start = micro * per_micro + offset
            chunk = slice(start, start + sizes[rank])
            x = inputs[chunk] if dtype is None else inputs[chunk].to(dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), targets[chunk]))
            engine.step()
        if after_step is not None:
            after_step(step + 1)


def train_on_rank(rank, world_size, stage, gas, sizes, clipping, strategy="manual"):
    """This rank's slice of every global micro-batch, as the heterogeneous sampler would give it."""
    import deepspeed

    model = make_model()
    config = ds_config(stage, gas, sizes, clipping, strategy)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    plan = engine.heterogeneous_plan
    assert list(plan.micro_batch_sizes) == list(sizes), plan
    assert engine.train_micro_batch_size_per_gpu() == sizes[rank]
    offset, per_micro = sum(sizes[:rank]), sum(sizes)
    for inputs, targets in global_batches(config["train_batch_size"]):
        for micro in range(gas):
            start = micro * per_micro + offset
            chunk = slice(start, start + sizes[rank])
            loss = torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk])
            reported = engine.backward(loss)
            # The loss handed back for logging is the rank's own, not the weighted one.
            torch.testing.assert_close(reported, loss.detach() / gas)
            engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return [p.detach().clone() for p in engine.module.parameters()]


CASES = [
    dict(stage=0, gas=1, sizes=[5, 3], clipping=0.0),
    dict(stage=0, gas=2, sizes=[7, 1], clipping=1.0),
    dict(stage=1, gas=1, sizes=[7, 1], clipping=0.0),
    dict(stage=1, gas=2, sizes=[5, 3], clipping=0.05),
    dict(stage=2, gas=1, sizes=[5, 3], clipping=0.05),
    dict(stage=2, gas=2, sizes=[7, 1], clipping=0.0),
    dict(stage=3, gas=1, sizes=[7, 1], clipping=1.0),
    dict(stage=3, gas=2, sizes=[5, 3], clipping=0.0),
]


@pytest.mark.multiprocess
def test_uneven_micro_batches_equal_single_process_training():
    results = run_subcases(train_on_rank, CASES, world_size=2, timeout=600)
    for case, per_rank in zip(CASES, results):
        expected = reference_parameters(sum(case["sizes"]) * case["gas"], case["clipping"])
        for rank_params in per_rank:
            for got, want in zip(rank_params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


@pytest.mark.multiprocess
def test_uniform_strategy_is_bit_identical_to_plain_deepspeed():
    """`uniform` with the fork enabled must not change a single bit against the same config
    without the heterogeneous block (which is upstream's code path: weight 1.0 is never applied)."""
    cases = [dict(stage=stage, gas=1, sizes=[4, 4], clipping=1.0, strategy=strategy)
             for stage in (1, 3) for strategy in ("uniform", "off")]
    results = run_subcases(_uniform_or_off, cases, world_size=2, timeout=600)
    for index in (0, 2):
        for got, want in zip(results[index][0], results[index + 1][0]):
            assert torch.equal(got, want), cases[index]


def _uniform_or_off(rank, world_size, stage, gas, sizes, clipping, strategy):
    import deepspeed

    model = make_model()
    config = ds_config(stage, gas, sizes, clipping, "uniform")
    if strategy == "off":
        del config["heterogeneous_config"]
        config["train_micro_batch_size_per_gpu"] = sizes[rank]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offset = sum(sizes[:rank])
    for inputs, targets in global_batches(config["train_batch_size"]):
        chunk = slice(offset, offset + sizes[rank])
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return [p.detach().clone() for p in engine.module.parameters()]


def sgd_reference(train_batch_size, lr):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for inputs, targets in global_batches(train_batch_size):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_bf16(rank, world_size, stage, sizes):
    import deepspeed

    model = make_model()
    config = ds_config(stage, 1, sizes, 0.0)
    config.update(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": BF16_LR}},
                  zero_allow_untested_optimizer=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offset = sum(sizes[:rank])
    for inputs, targets in global_batches(config["train_batch_size"]):
        chunk = slice(offset, offset + sizes[rank])
        out = engine(inputs[chunk].to(torch.bfloat16))
        engine.backward(torch.nn.functional.mse_loss(out.float(), targets[chunk]))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return [p.detach().float().clone() for p in engine.module.parameters()]


BF16_LR = 0.1


@pytest.mark.multiprocess
def test_bf16_uneven_micro_batches_track_the_reference():
    """bf16 rounds activations and gradients to 8 mantissa bits (relative error up to ~4e-3 per
    value). With SGD (Adam would turn the sign of near-zero bf16 gradients into whole steps) five
    steps of lr 0.1 move a parameter by ~1e-1, so bf16 rounding accounts for ~1e-3 at most; an
    unweighted average of the two ranks' gradients (off by 20-40%) would miss by ~1e-2 or more.
    Hence 2.5e-3, which separates the two."""
    cases = [dict(stage=1, sizes=[5, 3]), dict(stage=2, sizes=[7, 1])]
    results = run_subcases(train_bf16, cases, world_size=2, timeout=600)
    for case, per_rank in zip(cases, results):
        expected = sgd_reference(sum(case["sizes"]), BF16_LR)
        for got, want in zip(per_rank[0], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=2.5e-3, msg=lambda m: f"{case}: {m}")


# -- a loss that is a mean over valid tokens (heterogeneous_config.loss_items) ------------------

VOCAB, TAGS, TOKENS = 24, 5, 6


class Tagger(torch.nn.Module):
    """Tags every token; its loss is the mean over the tokens whose label is not -100."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(20261204)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, TAGS)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids)))
        return torch.nn.functional.cross_entropy(logits.view(-1, TAGS), labels.reshape(-1), ignore_index=-100)


def tagged_batches(train_batch_size, steps=STEPS):
    """Token ids and labels, a random number of each row's labels masked with -100, so that the
    ranks' token counts differ from their row counts."""
    generator = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (train_batch_size, TOKENS), generator=generator)
        labels = torch.randint(0, TAGS, (train_batch_size, TOKENS), generator=generator)
        keep = torch.rand(train_batch_size, 1, generator=generator) * TOKENS
        labels[torch.arange(TOKENS).expand(train_batch_size, TOKENS) >= keep.ceil()] = -100
        batches.append((ids, labels))
    return batches


# SGD: Adam divides each gradient by its own magnitude, so an element whose gradient cancels to
# ~1e-8 in some step moves by a sizeable part of the learning rate, and a rounding-level change
# of that gradient (summation order) moves the result by ~1e-5 while the losses agree.
TAGGER_LR = 0.5


def tagger_reference(train_batch_size, gas):
    """One process: each micro-step's loss is the token mean over that round of the global batch
    (all ranks' rows), averaged over the accumulation steps as DeepSpeed does."""
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=TAGGER_LR)
    per_round = train_batch_size // gas
    for ids, labels in tagged_batches(train_batch_size):
        optimizer.zero_grad()
        for micro in range(gas):
            rows = slice(micro * per_round, (micro + 1) * per_round)
            (model(ids[rows], labels[rows]) / gas).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_tagger(rank, world_size, stage, gas, sizes, loss_items):
    import deepspeed

    model = Tagger()
    config = ds_config(stage, gas, sizes, 0.0)
    config.update(optimizer={"type": "SGD", "params": {"lr": TAGGER_LR}}, zero_allow_untested_optimizer=True)
    if loss_items is not None:
        config["heterogeneous_config"]["loss_items"] = loss_items
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offset, per_round = sum(sizes[:rank]), sum(sizes)
    for ids, labels in tagged_batches(config["train_batch_size"]):
        for micro in range(gas):
            rows = slice(micro * per_round + offset, micro * per_round + offset + sizes[rank])
            if loss_items is not None and loss_items.get("input") == "labels":
                loss = engine(ids[rows], labels=labels[rows])
            else:
                loss = engine(ids[rows], labels[rows])
            engine.backward(loss)
            engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.multiprocess
def test_token_mean_loss_is_exact_with_loss_items():
    """A tagger whose loss is cross_entropy(..., ignore_index=-100) over the rows it computed: with
    ``loss_items`` the ranks are weighted by their labelled tokens, and [12, 4] equals one process
    on the global batch to 1e-6 (by keyword and by position, ZeRO-1 and 2, with accumulation).
    Without it the rows weight the token means, which the control case shows is off."""
    cases = [dict(stage=1, gas=1, sizes=[12, 4], loss_items={"input": "labels"}),
             dict(stage=2, gas=2, sizes=[12, 4], loss_items={"input": 1, "ignore_index": -100}),
             dict(stage=1, gas=1, sizes=[12, 4], loss_items=None)]
    results = run_subcases(train_tagger, cases, world_size=2, timeout=600)
    for case, per_rank in zip(cases, results):
        expected = tagger_reference(sum(case["sizes"]) * case["gas"], case["gas"])
        gap = max((got - want).abs().max().item() for got, want in zip(per_rank[0], expected))
        if case["loss_items"] is None:
            assert gap > 1e-4, f"the rows' weights should miss the token mean: {gap:.3g}"
            continue
        for rank_params in per_rank:
            for got, want in zip(rank_params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{case}: {m}")
