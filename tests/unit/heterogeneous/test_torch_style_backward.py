# SPDX-License-Identifier: Apache-2.0
"""``loss.backward()`` called directly (torch style) weights a rank's loss like ``engine.backward``.

Upstream lets users call ``loss.backward()`` on the engine's output instead of
``engine.backward(loss)`` whenever the optimizer is a ZeRO optimizer (stages 1-3; stage 0 raises).
That path never enters ``engine.backward``: the gradient reaching the output is scaled by a hook
the engine registers in ``forward`` (``_backward_prologue_per_tensor``), so the fork's per-rank
loss weight has to be applied there too. Two ranks with uneven micro-batches train a few steps
that way in ZeRO 1-3, with and without gradient accumulation; every parameter must equal
single-process training on the global batch. ZeRO-0 must keep refusing ``loss.backward()``.
"""

import pytest
import torch

from harness import run_subcases
from references import adam_mse_reference

WIDTH = 16
STEPS = 3
LR = 1e-3
ATOL = 1e-5


def make_model():
    torch.manual_seed(424242)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def data(train_batch_size):
    """Every step's global batch, back to back: samples ``[k * train_batch_size, (k+1) * train_batch_size)``."""
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(STEPS * train_batch_size, WIDTH, generator=generator)
    targets = torch.randn(STEPS * train_batch_size, WIDTH, generator=generator)
    return inputs, targets


def rank_indices(step, micro, rank, sizes, gas):
    """The samples rank ``rank`` takes in micro-step ``micro`` of optimizer step ``step``."""
    start = step * sum(sizes) * gas + micro * sum(sizes) + sum(sizes[:rank])
    return list(range(start, start + sizes[rank]))


def train_torch_style(rank, world_size, stage, gas, sizes):
    import deepspeed

    model = make_model()
    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # Without these the case would not exercise the weighted torch-style path at all.
    assert engine._support_torch_style_backward == (stage > 0), "torch-style backward support is not upstream's"
    assert list(engine.heterogeneous_plan.micro_batch_sizes) == sizes
    assert engine.train_micro_batch_size_per_gpu() == sizes[rank]
    assert engine.heterogeneous_plan.loss_weights[rank] != 1.0

    inputs, targets = data(config["train_batch_size"])
    if stage == 0:
        # Upstream supports torch-style backward only with a ZeRO optimizer; ZeRO-0 must refuse
        # rather than train without the weight.
        loss = torch.nn.functional.mse_loss(engine(inputs[:sizes[rank]]), targets[:sizes[rank]])
        try:
            loss.backward()
        except RuntimeError as exc:
            assert "engine.backward(loss)" in str(exc), exc
            return None
        raise AssertionError("loss.backward() under ZeRO-0 did not refuse")
    for step in range(STEPS):
        for micro in range(gas):
            chunk = rank_indices(step, micro, rank, sizes, gas)
            loss = torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk])
            loss.backward()
            engine.step()
    assert engine.global_steps == STEPS
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return [p.detach().clone() for p in engine.module.parameters()]


def step_indices(sizes, gas):
    """Per optimizer step, every sample of the global batch (all ranks, all micro-steps)."""
    return [[i for micro in range(gas) for rank in range(len(sizes))
             for i in rank_indices(step, micro, rank, sizes, gas)] for step in range(STEPS)]


def unweighted_reference(sizes, gas):
    """What training gives if each rank's mean loss counts equally (the weight forgotten): the
    mean over ranks and micro-steps of per-chunk means, not the mean over the global batch."""
    inputs, targets = data(sum(sizes) * gas)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        chunks = [rank_indices(step, micro, rank, sizes, gas) for micro in range(gas) for rank in range(len(sizes))]
        loss = sum(torch.nn.functional.mse_loss(model(inputs[c]), targets[c]) for c in chunks) / len(chunks)
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


CASES = [
    dict(stage=0, gas=1, sizes=[6, 2]),
    dict(stage=1, gas=1, sizes=[6, 2]),
    dict(stage=2, gas=2, sizes=[6, 2]),
    dict(stage=3, gas=1, sizes=[7, 1]),
    dict(stage=3, gas=2, sizes=[6, 2]),
]


@pytest.mark.multiprocess
def test_torch_style_backward_with_uneven_micro_batches_equals_single_process_training():
    results = run_subcases(train_torch_style, CASES, world_size=2, timeout=600)
    for case, per_rank in zip(CASES, results):
        if case["stage"] == 0:
            continue  # refused on every rank, checked there
        inputs, targets = data(sum(case["sizes"]) * case["gas"])
        expected = adam_mse_reference(make_model(), inputs, targets, step_indices(case["sizes"], case["gas"]), LR)
        # The comparison can fail: forgetting the weight moves some parameter by far more than ATOL.
        forgotten = unweighted_reference(case["sizes"], case["gas"])
        assert max((a - b).abs().max().item() for a, b in zip(forgotten, expected)) > 20 * ATOL, case
        for rank_params in per_rank:
            for got, want in zip(rank_params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{case}: {m}")
