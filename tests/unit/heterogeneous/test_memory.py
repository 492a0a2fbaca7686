# SPDX-License-Identifier: Apache-2.0
"""Memory limits feed the planner: the model-state and activation model, per-rank gas that memory
forces in ZeRO-0/1 (exact against a single-process reference), and the memory errors."""

import pytest
import torch

from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
from deepspeed.runtime.heterogeneous.memory.model_state import (ActivationMeter, ActivationModel, RankCannotFitError,
                                                                fit_activation_model, max_micro_batch,
                                                                model_state_bytes, optimizer_state_bytes)
from harness import predicted_state_bytes, run_ranks, run_subcases
from references import adam_mse_reference

# -- the pure model -------------------------------------------------------------------------------


# ZeRO 1-3 update an fp32 copy of their partition even in fp32 training: 4 more bytes per parameter.
@pytest.mark.parametrize("stage, expected", [(0, 1000 * (4 + 4 + 8)), (1, 1000 * (4 + 4) + 1000 * (8 + 4) / 4),
                                             (2, 1000 * 4 + 1000 * (4 + 8 + 4) / 4), (3, 1000 * (4 + 4 + 8 + 4) / 4)])
def test_model_state_follows_zero_sharding(stage, expected):
    assert model_state_bytes(1000, stage, 4, param_bytes=4, optimizer_bytes=8) == expected


def test_a_rank_share_replaces_one_nth_of_what_its_stage_partitions():
    full = dict(param_bytes=4, optimizer_bytes=8)
    assert model_state_bytes(1000, 2, 4, share=0.1, **full) == 1000 * 4 + 1000 * (4 + 8 + 4) * 0.1
    assert model_state_bytes(1000, 1, 4, share=0.7, **full) == 1000 * (4 + 4) + 1000 * (8 + 4) * 0.7
    # ZeRO-3: the share of every parameter, so of its gradient and optimizer state too.
    assert model_state_bytes(1000, 3, 4, share=0.7, **full) == pytest.approx(1000 * (4 + 4 + 8 + 4) * 0.7)
    assert model_state_bytes(1000, 0, 4, share=0.7, **full) == model_state_bytes(1000, 0, 4, **full)


def test_model_state_with_mixed_precision_and_offload():
    # fp16 params and grads, Adam's two fp32 states plus the fp32 master copy: 16 bytes/param.
    assert model_state_bytes(10, 0, 1, param_bytes=2, optimizer_bytes=8, master_bytes=4) == 10 * 16
    assert model_state_bytes(10, 1, 2, param_bytes=2, optimizer_bytes=8, master_bytes=4,
                             optimizer_offloaded=True) == 10 * 4
    with pytest.raises(ValueError, match="zero_stage 4"):
        model_state_bytes(10, 4, 1)


def test_optimizer_state_bytes():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_state_bytes(torch.optim.Adam(params)) == 8
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1)) == 0
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 4
    assert optimizer_state_bytes("FusedLion") == 4
    assert optimizer_state_bytes("SomethingNew") == 8  # unknown: assumed Adam-like, the safe side


def test_activation_fit():
    assert fit_activation_model([(4, 400.0)]) == ActivationModel(0.0, 100.0)
    model = fit_activation_model([(2, 250.0), (4, 450.0), (4, 450.0)])
    assert model.base == pytest.approx(50.0) and model.per_sample == pytest.approx(100.0)
    # A negative intercept is clamped; the slope then still covers every measurement.
    model = fit_activation_model([(2, 100.0), (4, 300.0)])
    assert model.base == 0.0 and all(model.bytes_for(m) >= b for m, b in [(2, 100.0), (4, 300.0)])
    with pytest.raises(ValueError, match="at least one"):
        fit_activation_model([])


def test_max_micro_batch():
    activations = ActivationModel(base=100.0, per_sample=50.0)
    assert max_micro_batch(None, 10, activations) is None
    assert max_micro_batch(1000, 400, activations) == 10
    assert max_micro_batch(1000, 400, activations, utilization=0.8) == 6  # 800 - 400 - 100 = 300
    with pytest.raises(RankCannotFitError, match=r"data-parallel rank 3 \(T4\) cannot hold one sample"):
        max_micro_batch(1000, 900, activations, rank_label="data-parallel rank 3 (T4)")


def test_activation_meter_counts_saved_activations_not_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    meter = ActivationMeter()
    counted = {}
    for size in (1, 3):
        meter.start()
        loss = torch.nn.functional.mse_loss(model(torch.randn(size, 64)), torch.randn(size, 64))
        counted[size] = meter.stop()
        loss.backward()
    # Input, tanh output (also linear2's input: counted once), output and target, in fp32, and the
    # largest (the tanh output) again, its gradient in flight; the weights the linears save
    # (weight.t() views) are model state.
    assert counted == {1: (64 + 256 + 64 + 64 + 256) * 4, 3: 3 * (64 + 256 + 64 + 64 + 256) * 4}
    assert not meter.active and meter.stop() == 0


# -- end to end: memory forces per-rank gas -------------------------------------------------------

WIDTH, HIDDEN = 64, 256
DATASET = 160
TRAIN_BATCH = 16
LR = 1e-3
ACTIVATION_BYTES_PER_SAMPLE = (WIDTH + HIDDEN + WIDTH + WIDTH + HIDDEN) * 4  # measured above


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))


def dataset():
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), torch.randn(DATASET, WIDTH, generator=generator),
                                          torch.randn(DATASET, WIDTH, generator=generator))


ADAM = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}


def memory_gb_for(stage, samples, world=2):
    """Emulated capacity (GiB) that holds ``samples`` per micro-step (plus half a sample of slack)
    beside what the fork's memory model predicts for the rest."""
    state = predicted_state_bytes(make_model(), stage, world, ADAM)
    return (state + ACTIVATION_BYTES_PER_SAMPLE * (samples + 0.5)) / BYTES_PER_GB


def memory_config(stage, caps, profile_steps=3, **extra):
    # Memory by accounting (mode dilation, no memory cgroup): the capacity is a device apart from the
    # host, as memory_gb_for counts it, on every machine (the cgroup case: test_memory_limits.py).
    heterogeneous = {"enabled": True, "load_balancing_strategy": "compute_aware", "profile_steps": profile_steps,
                     "emulation": {"memory_gb": [memory_gb_for(stage, cap) for cap in caps], "mode": "dilation"}}
    heterogeneous.update(extra)
    return {"train_batch_size": TRAIN_BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": ADAM, "heterogeneous_config": heterogeneous,
            "heterogeneous_memory": {"hbm_utilization_threshold": 1.0}}


def train_within_memory(rank, world_size, stage, caps, steps):
    import deepspeed

    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=memory_config(stage, caps), training_data=dataset())
    per_step = [[] for _ in range(steps)]
    micro_steps = [0] * steps
    batches = iter(loader)
    while engine.global_steps < steps:
        index, inputs, targets = next(batches)
        assert len(index) == engine.train_micro_batch_size_per_gpu()
        per_step[engine.global_steps] += index.tolist()
        micro_steps[engine.global_steps] += 1
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    plan = engine.heterogeneous_plan
    return {"per_step": per_step, "micro_steps": micro_steps, "plan": plan.to_dict(),
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def reference(step_indices):
    _, inputs, targets = dataset().tensors
    return adam_mse_reference(make_model(), inputs, targets, step_indices, LR)


@pytest.mark.multiprocess
def test_memory_limits_force_per_rank_gas_and_training_stays_exact():
    steps, caps = 8, [2, 3]
    cases = [dict(stage=0, caps=caps, steps=steps), dict(stage=1, caps=caps, steps=steps)]
    for case, (first, second) in zip(cases, run_subcases(train_within_memory, cases, world_size=2, timeout=600)):
        plan = first["plan"]
        assert plan == second["plan"]
        # 2 + 3 samples fit per micro-step, fewer than the 16 of the global batch: the ranks
        # accumulate, each within its own limit, the global batch unchanged.
        assert all(m <= cap for m, cap in zip(plan["micro_batch_sizes"], caps)), plan
        assert min(plan["gradient_accumulation_steps"]) > 1, plan
        assert any("memory limits" in note for note in plan["notes"]), plan
        assert sum(m * g for m, g in zip(plan["micro_batch_sizes"], plan["gradient_accumulation_steps"])) == 16
        # Each rank ran its own number of micro-steps per optimizer step once the plan was in force.
        assert first["micro_steps"][-1] == plan["gradient_accumulation_steps"][0], (first["micro_steps"], plan)
        assert second["micro_steps"][-1] == plan["gradient_accumulation_steps"][1], (second["micro_steps"], plan)
        step_indices = [a + b for a, b in zip(first["per_step"], second["per_step"])]
        assert [len(step) for step in step_indices] == [TRAIN_BATCH] * steps
        assert len({i for step in step_indices for i in step}) == steps * TRAIN_BATCH, case  # none repeated
        for got, want in zip(first["params"], reference(step_indices)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


def _train_expecting_error(rank, world_size, config, steps=4):
    import deepspeed

    model = make_model()
    try:
        engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                    training_data=dataset())
        batches = iter(loader)
        while engine.global_steps < steps:
            _, inputs, targets = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.multiprocess
def test_memory_errors_stop_every_rank_with_the_reason():
    cases = [
        # Rank 1 cannot hold one sample: every rank stops after the first profiling step.
        dict(config=memory_config(0, [4, 0])),
        # ZeRO-2 needs equal gas, and 2 + 3 samples per micro-step cannot make 16.
        dict(config=memory_config(2, [2, 3])),
    ]
    cannot_fit, zero2 = run_subcases(_train_expecting_error, cases, world_size=2, timeout=300)
    for message in cannot_fit:
        assert "data-parallel rank 1" in message and "cannot hold one sample" in message, message
        assert "hbm_utilization_threshold" in message, message
    for message in zero2:
        assert "memory limits allow 5 samples per micro-step" in message, message
        assert "gradient_accumulation_steps 4 would fit" in message, message


def _over_emulated_memory(rank, world_size):
    import deepspeed

    model = make_model()
    config = memory_config(0, [3, 16], profile_steps=0, load_balancing_strategy="manual", micro_batch_sizes=[8, 8])
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    _, inputs, targets = next(iter(loader))
    engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
    engine.step()


@pytest.mark.multiprocess
def test_a_fixed_plan_over_emulated_memory_fails_as_out_of_memory():
    with pytest.raises(AssertionError) as info:
        run_ranks(_over_emulated_memory, world_size=2, timeout=180)
    report = str(info.value)
    # Rank 0 returns the error; its peer, left alone in a collective, fails rather than hangs.
    assert "EmulatedOutOfMemoryError" in report or "out of memory" in report, report


def test_an_engine_is_counted_through_its_model_state_inputs():
    """The autotuner's profile and the one memory model (``ModelStateSpec``) count an engine's
    model state from engine_model_state_inputs."""
    from types import SimpleNamespace
    from deepspeed.runtime.heterogeneous.memory.model_state import engine_model_state_inputs
    from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec

    module = torch.nn.Linear(10, 10)  # 110 trainable parameters
    module.bias.requires_grad_(False)  # 100 count
    optimizer = torch.optim.Adam(module.parameters())
    engine = SimpleNamespace(module=module, fp16_enabled=lambda: False, bfloat16_enabled=lambda: True,
                             basic_optimizer=None, optimizer=optimizer, zero_use_cpu_optimizer=lambda: False,
                             zero_optimization_stage=lambda: 2,
                             _config=SimpleNamespace(heterogeneous=SimpleNamespace(partition_share=None),
                                                     zero_config=SimpleNamespace(stage=2, offload_optimizer=None)))
    inputs = engine_model_state_inputs(engine)
    assert inputs == {"num_parameters": 100, "param_bytes": 2, "optimizer_bytes": 8, "master_bytes": 4,
                      "optimizer_offloaded": False}
    spec = ModelStateSpec._from_inputs(inputs, 2, None)
    assert spec.state_bytes(4) == model_state_bytes(100, 2, 4, 2, 8, 4) == 200 + 50 + 300


def test_start_up_limits_before_any_activation_was_measured():
    """Until activations are measured, a rank with a known limit holds its room's proportion of the
    micro-step (at least one sample), the limits adding up to the micro-step; equal rooms give
    equal limits, whatever the datasheet speeds."""
    from deepspeed.runtime.heterogeneous.memory.model_state import startup_memory_limits

    gib = BYTES_PER_GB
    # 18 samples per micro-step on 2 ranks: equal rooms, equal limits.
    assert startup_memory_limits([16 * gib, 16 * gib], [0, 0], 0.85, 18) == [9, 9]
    assert startup_memory_limits([80 * gib, 16 * gib], [0, 0], 1.0, 18) == [15, 3]
    # Model state counts against the room: 10 of 20 GiB left vs 40 of 50 GiB (3.6 and 14.4 samples:
    # the larger remainder takes the sample the floors leave over).
    assert startup_memory_limits([20 * gib, 50 * gib], [10 * gib, 10 * gib], 1.0, 18) == [4, 14]
    assert startup_memory_limits([gib, gib], [0, 0], 1.0, 15) == [8, 7]
    # A rank far smaller than the others still runs one sample.
    assert startup_memory_limits([100 * gib, gib // 10], [0, 0], 1.0, 18) == [17, 1]
    # Unknown capacity: no limit there; it counts with what it may use, else with the largest room.
    assert startup_memory_limits([None, 16 * gib], [0, 0], 1.0, 18) == [None, 9]
    assert startup_memory_limits([None, gib], [0, gib // 2], 0.85, 224, unlimited_bytes=[12 * gib, 12 * gib]) == \
        [None, 6]
    assert startup_memory_limits([None, None], [0, 0], 1.0, 18) == [None, None]
    with pytest.raises(RankCannotFitError, match=r"data-parallel rank 1 \(T4\) cannot hold its model state"):
        startup_memory_limits([16 * gib, 16 * gib], [0, 15 * gib], 0.85, 18,
                              ["data-parallel rank 0 (A10)", "data-parallel rank 1 (T4)"])


def test_start_up_plan_from_priors_keeps_within_memory():
    """The datasheet prior of an H100 next to a V100 (989 vs 125 TFLOP/s) is 8:1; with the same
    memory on both, the start-up limits bring it back to an equal split, the planner's own rule."""
    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
    from deepspeed.runtime.heterogeneous.startup import initial_plan
    from deepspeed.runtime.heterogeneous.memory.model_state import startup_memory_limits

    settings = load_heterogeneous_settings({"heterogeneous_config": {"enabled": True}}, environ={})
    devices = [_device("NVIDIA H100 80GB HBM3", 989.0), _device("Tesla V100-SXM2-16GB", 125.0)]
    free = initial_plan(settings, 18, 1, 2, 0, devices)
    assert list(free.micro_batch_sizes) == [16, 2]
    limits = startup_memory_limits([16 * BYTES_PER_GB] * 2, [BYTES_PER_GB] * 2, 0.85, 18)
    assert limits == [9, 9]
    capped = initial_plan(settings, 18, 1, 2, 2, devices, max_micro_batch=limits)  # ZeRO-2: one gas
    assert list(capped.micro_batch_sizes) == [9, 9]
    # ZeRO-0/1 may give the fast rank more micro-steps instead, each within its limit.
    capped = initial_plan(settings, 18, 1, 2, 0, devices, max_micro_batch=limits)
    assert list(capped.micro_batch_sizes) == [8, 2] and list(capped.gradient_accumulation_steps) == [2, 1]


def _device(name, score):
    from deepspeed.runtime.heterogeneous.measure.devices import DeviceDescription
    return DeviceDescription(rank=0, local_rank=0, host="h", name=name, memory_bytes=16 * BYTES_PER_GB, bf16=True,
                             fp16=True, accelerator="cuda", spec_score=score, score_source="spec")


def test_one_memory_model_for_a_config_and_a_model_at_two_levels_of_detail():
    """The start-up cap, the runtime and the pool ask one model (``ModelStateSpec.for_engine``) of
    a DeepSpeedConfig and a model: its first level is the model state a rank keeps, its second the
    predicted peak with DeepSpeed's buffers, which ``rank_bytes`` (what the planner counts besides
    activations) gives whenever the allocations are known, as they always are for a model."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec

    model = torch.nn.Linear(10, 10)  # 110 parameters
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}
    adam = DeepSpeedConfig({**base, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert ModelStateSpec.for_engine(adam, model).state_bytes(1) == model_state_bytes(110, 0, 1, 4, 8)
    bf16 = DeepSpeedConfig({**base, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = ModelStateSpec.for_engine(bf16, model, sgd)
    assert spec.state_bytes(1) == model_state_bytes(110, 2, 1, 2, 0, 4)
    peak = spec.peak(None)
    assert spec.rank_bytes(bf16) == spec.device_bytes(1, None) == peak.peak_bytes > spec.state_bytes(1)
    # The second level holds the first: the partition's fp32 copy and optimizer state are in it.
    kept = peak.phases[peak.peak_phase]
    assert kept["fp32 partition"] + kept["optimizer state"] == pytest.approx(110 * 4)
    offload = DeepSpeedConfig({**base, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    spec = ModelStateSpec.for_engine(offload, model)
    assert spec.state_bytes(1) == model_state_bytes(110, 1, 1, 4, 8, optimizer_offloaded=True)
    # Without allocations (a profile of another run) the model state is the answer.
    bare = ModelStateSpec(num_parameters=110, zero_stage=1, optimizer_device="cpu")
    assert bare.device_bytes(1, None) == bare.state_bytes(1) == spec.state_bytes(1)
    # Frozen parameters (a LoRA model's base) keep no state but are what ZeRO-3 gathers too.
    lora = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    lora[0].requires_grad_(False)
    spec = ModelStateSpec.for_engine(adam, lora)
    assert spec.num_parameters == spec.allocations.num_parameters == 22
    assert spec.allocations.frozen_parameters == 110
