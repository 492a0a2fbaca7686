# SPDX-License-Identifier: Apache-2.0
"""A load-balancing strategy of one's own: one module outside the package
(``examples/strategies/proportional.py``), one registration, and the engine trains with it,
profiling and re-planning through it, exactly as single-process training on the same samples."""

import sys

import pytest
import torch

from deepspeed.runtime.heterogeneous.config.strategies import (BalancingStrategy, get_strategy, register_strategy,
                                                               strategy_names, unregister_strategy)
from deepspeed.runtime.heterogeneous.planning.planner import Plan, TimeModel, plan_micro_batches
from harness import REPO_ROOT, VirtualDevice, run_subcases
from references import adam_mse_reference

STRATEGIES_DIR = str(REPO_ROOT / "examples" / "strategies")
WIDTH, DATASET, BATCH, LR = 16, 96, 16, 0.1
SECONDS_PER_SAMPLE = 0.01  # virtual, at speed 1.0
SPEEDS = (1.0, 0.25)


def _proportional():
    if STRATEGIES_DIR not in sys.path:
        sys.path.insert(0, STRATEGIES_DIR)
    import proportional  # registers "proportional" when first imported
    if "proportional" not in strategy_names():
        register_strategy(proportional.Proportional())  # a test before unregistered it
    return get_strategy("proportional")


@pytest.fixture(autouse=True)
def _registry_as_found():
    """The pytest process's registry is left as each test found it: other tests list the
    registered names."""
    before = strategy_names()
    yield
    for name in set(strategy_names()) - set(before):
        unregister_strategy(name)


def test_the_example_strategy_plans_in_proportion_to_speed():
    strategy = _proportional()
    assert "proportional" in strategy_names() and strategy.adapts and not strategy.takes_sizes
    models = [TimeModel(0.0, 1.0), TimeModel(0.0, 4.0)]
    plan = plan_micro_batches(models, train_batch_size=32, gradient_accumulation_steps=2, strategy="proportional")
    # 16 per micro-step in proportion 1 : 0.25 = 12.8 : 3.2; the remainder goes to rank 0.
    assert list(plan.micro_batch_sizes) == [13, 3] and plan.strategy == "proportional"
    assert list(plan.gradient_accumulation_steps) == [2, 2]
    # At least one sample per rank, however slow.
    plan = plan_micro_batches([TimeModel(0.0, 1.0)] + [TimeModel(0.0, 1000.0)] * 3, 6, strategy="proportional")
    assert list(plan.micro_batch_sizes) == [3, 1, 1, 1]


class _Broken(BalancingStrategy):
    name = "broken"

    def plan(self, request):
        return request.fixed_plan([1] * request.world_size)  # not the whole batch


class _Unfinished(BalancingStrategy):
    name = "unfinished"


class _UnevenGas(BalancingStrategy):
    name = "uneven_gas"

    def plan(self, request):
        return Plan([4, 8], [2, 1], request.train_batch_size, self.name, [1.0, 1.0])


def test_registration_refuses_what_would_break_a_run():
    _proportional()
    with pytest.raises(ValueError, match="'proportional' is already registered"):
        register_strategy(type(get_strategy("proportional"))())
    with pytest.raises(ValueError, match="lower case letters"):
        register_strategy(type("Bad", (_Broken, ), {"name": "Fast-Split"})())
    with pytest.raises(TypeError, match="does not implement plan"):
        register_strategy(_Unfinished())
    with pytest.raises(TypeError, match="BalancingStrategy instance"):
        register_strategy("proportional")
    register_strategy(_Broken())
    with pytest.raises(ValueError, match="differs from train_batch_size 8"):  # the Plan itself refuses
        plan_micro_batches([TimeModel(0.0, 1.0)] * 2, 8, strategy="broken")
    # Ranks running different numbers of micro-steps, where every micro-step reduces (ZeRO-2/3).
    register_strategy(_UnevenGas())
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \[2, 1\]; allowed: 1 on every rank"):
        plan_micro_batches([TimeModel(0.0, 1.0)] * 2, 16, strategy="uneven_gas")
    assert plan_micro_batches([TimeModel(0.0, 1.0)] * 2, 16, strategy="uneven_gas",
                              allow_per_rank_gas=True).per_rank_gas
    unregister_strategy("broken")
    assert "broken" not in strategy_names()


def _data():
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), torch.randn(DATASET, WIDTH, generator=generator),
                                          torch.randn(DATASET, WIDTH, generator=generator))


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def _train_with_the_example(rank, world_size, stage):
    import deepspeed
    _proportional()
    device = VirtualDevice(SECONDS_PER_SAMPLE, speed=SPEEDS[rank])
    model = torch.nn.Sequential(*_model(), device.layer())
    config = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "proportional", "profile_steps": 3}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=_data())
    seen, plans = [], []
    with device.installed():
        for index, inputs, targets in loader:
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
            seen.append(index.tolist())
            plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"seen": seen, "plans": plans, "strategy": engine.heterogeneous_plan.strategy, "params": params}


def _reference(step_indices):
    """One process, SGD on the mean squared error of each step's samples (the ranks' together)."""
    _, inputs, targets = _data().tensors
    return adam_mse_reference(_model(), inputs, targets, step_indices, LR, optimizer_class=torch.optim.SGD)


@pytest.mark.multiprocess
def test_the_engine_trains_exactly_with_a_registered_strategy():
    cases = [dict(stage=1), dict(stage=3)]
    for case, (fast, slow) in zip(cases, run_subcases(_train_with_the_example, cases, world_size=2, timeout=600)):
        assert fast["plans"] == slow["plans"] and fast["strategy"] == "proportional", case
        # plans[k]: the plan after step k + 1. From the third (last) profiling step on, the strategy's
        # plan for the measured speeds 1 : 0.25, kept to the end of the epoch.
        assert fast["plans"][2:] == [[13, 3]] * (DATASET // BATCH - 2), (case, fast["plans"])
        step_indices = [a + b for a, b in zip(fast["seen"], slow["seen"])]
        assert sorted(i for step in step_indices for i in step) == list(range(DATASET)), case
        for got, want in zip(fast["params"], _reference(step_indices)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{case}: {m}")
