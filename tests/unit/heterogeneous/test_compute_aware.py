# SPDX-License-Identifier: Apache-2.0
"""Compute-aware training end to end on two ranks: a slow rank (on virtual devices, so that
profiling's plan is the same in every run), profiling steps that re-plan, the engine's loader
following the plan; and the failures that must not hang."""

import os

import pytest
import torch

from harness import VirtualDevice, run_ranks, run_subcases
from references import adam_mse_reference

WIDTH = 64
DATASET = 96
SEQUENCE = 16  # tokens per sample
SECONDS_PER_SAMPLE = 0.01  # virtual, at speed 1.0
# Adam turns summation-order rounding of near-zero gradients into steps of size ~lr; a modest lr
# keeps those within the 1e-5 tolerance without hiding a wrong weighting (which is off by 20-40%).
LR = 1e-3


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.Tanh(), torch.nn.Linear(256, WIDTH))


def dataset():
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(DATASET, SEQUENCE, WIDTH, generator=generator)
    targets = torch.randn(DATASET, SEQUENCE, WIDTH, generator=generator)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), inputs, targets)


def config(stage, speeds=(1.0, 0.25), **extra):
    heterogeneous = {"enabled": True, "load_balancing_strategy": "compute_aware", "profile_steps": 3,
                     "emulation": {"speeds": list(speeds), "mode": "dilation"}}
    heterogeneous.update(extra)
    return {"train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "heterogeneous_config": heterogeneous}


def train_compute_aware(rank, world_size, stage, steps):
    import deepspeed

    device = VirtualDevice(SECONDS_PER_SAMPLE, speed=(1.0, 0.25)[rank])
    model = torch.nn.Sequential(*make_model(), device.layer())
    settings = config(stage, profile_steps=5)
    del settings["heterogeneous_config"]["emulation"]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings,
                                                training_data=dataset())
    assert engine.train_batch_size() / engine.gradient_accumulation_steps() == 16  # the flops profiler's count
    try:
        engine.set_train_micro_batch_size(4)
        raise AssertionError("set_train_micro_batch_size must refuse: the plan owns batch sizes")
    except RuntimeError as exc:
        assert "heterogeneous_config" in str(exc)
    seen, sizes = [], []
    batches = iter(loader)
    with device.installed():
        for _ in range(steps):
            index, inputs, targets = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
            seen.append(index.tolist())
            sizes.append(len(index))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"seen": seen, "sizes": sizes, "params": params, "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


def reference(step_indices):
    """One process; step k trains on exactly the samples the ranks took at step k."""
    _, inputs, targets = dataset().tensors
    return adam_mse_reference(make_model(), inputs, targets, step_indices, LR)


@pytest.mark.multiprocess
def test_slow_rank_gets_less_work_and_training_stays_exact():
    steps = DATASET // 16  # one epoch
    cases = [dict(stage=1, steps=steps), dict(stage=3, steps=steps)]
    for case, (fast, slow) in zip(cases, run_subcases(train_compute_aware, cases, world_size=2, timeout=600)):
        assert fast["sizes"][0] == slow["sizes"][0] == 8, "start-up plan is even (no datasheet score for CPUs)"
        # Profiling moved work from the rank at a quarter of the speed to the fast one: 16 samples
        # in proportion 1 : 0.25, from the epoch's sixth step on.
        assert fast["plan"] == [13, 3], fast["plan"]
        assert fast["sizes"][-1] == fast["plan"][0] and slow["sizes"][-1] == slow["plan"][1]
        # Across plan changes, every sample of the epoch was used exactly once.
        step_indices = [a + b for a, b in zip(fast["seen"], slow["seen"])]
        assert sorted(i for step in step_indices for i in step) == list(range(DATASET)), case
        for got, want in zip(fast["params"], reference(step_indices)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


def _bad_sum(rank, world_size):
    import deepspeed

    model = make_model()
    cfg = config(2, load_balancing_strategy="manual", micro_batch_sizes=[5, 5], profile_steps=0)
    cfg["heterogeneous_config"].pop("emulation")
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_manual_sizes_that_miss_the_global_batch_fail_at_initialize():
    messages = run_ranks(_bad_sum, world_size=2, timeout=180)
    assert all(m and "10" in m and "16" in m for m in messages), messages


def _dies_while_profiling(rank, world_size):
    import deepspeed

    model = make_model()
    # ZeRO-0 without clipping: after backward's all-reduce, the next collective is the gather of
    # the profiling measurements at the step boundary, where rank 1 will be missing.
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config(0), training_data=dataset())
    batches = iter(loader)
    for step in range(3):
        _, inputs, targets = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        if rank == 1 and step == 1:
            os._exit(17)  # a crash, as a killed process would: no clean shutdown
        engine.step()


@pytest.mark.multiprocess
def test_a_rank_dying_while_the_plan_is_agreed_stops_the_others_with_a_message():
    with pytest.raises(AssertionError) as info:
        run_ranks(_dies_while_profiling, world_size=2, timeout=240)
    report = str(info.value)
    assert "rank 1 exited with code 17" in report
    assert "PlanAgreementError: deepspeed-hetero: data-parallel rank 0 could not gather the measurements of step 2" \
        in report
    assert "a peer rank failed or timed out" in report
