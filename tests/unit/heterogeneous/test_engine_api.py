# SPDX-License-Identifier: Apache-2.0
"""The engine's scheduling API (``HeterogeneousEngineMixin`` in engine.py): ``_get_device_score``,
``_normalize_scores``, ``_distribute_workload`` and ``schedule_heterogeneous_tasks``, called on a
real engine from ``deepspeed.initialize`` (one rank, the CPU accelerator). Every expected value is
worked out by hand from datasheet scores and the engine's batch; the pure functions behind the
methods have their own tests (test_planner.py, test_devices.py)."""

import pytest

from harness import run_subcases

TRAIN_BATCH = 24
GAS = 2  # 24 / 2 = 12 samples per micro-step to split


def _device(rank, name, score, source="spec"):
    from deepspeed.runtime.heterogeneous.measure.devices import DeviceDescription
    return DeviceDescription(rank=rank, local_rank=rank, host="h", name=name, memory_bytes=80 * 2**30, bf16=True,
                             fp16=True, accelerator="cuda", spec_score=score, score_source=source)


def _engine_api(rank, world_size, enabled):
    import deepspeed
    import torch

    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": TRAIN_BATCH, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "heterogeneous_config": {"enabled": enabled, "load_balancing_strategy": "uniform"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    in_force = None if engine.heterogeneous_plan is None else engine.heterogeneous_plan.to_dict()
    a100 = _device(0, "NVIDIA A100-SXM4-80GB", 312.0)
    v100 = _device(1, "Tesla V100-SXM2-32GB", 125.0)
    result = {
        "score_description": engine._get_device_score(a100),
        "score_dict": engine._get_device_score(_device(0, "cpu", 0.7, "measured").to_dict()),
        "score_v100_by_name": engine._get_device_score({"name": "Tesla V100-SXM2-32GB"}),
        "score_a100_fp32": engine._get_device_score({"name": "NVIDIA A100-SXM4-80GB", "dtype": "fp32"}),
        "normalized": engine._normalize_scores([312.0, 125.0, 63.0]),
        "even_split": engine._distribute_workload([0.5, 0.25, 0.25]),
        "remainder_split": engine._distribute_workload([0.6, 0.4]),
    }
    for key, devices in (("scheduled", [a100, v100.to_dict()]),
                         ("unknown", [a100, _device(1, "Mystery", 0.0, "unknown")])):
        plan = engine.schedule_heterogeneous_tasks(devices)
        result[key] = {"sizes": list(plan.micro_batch_sizes), "gas": list(plan.gradient_accumulation_steps),
                       "batch": plan.train_batch_size, "strategy": plan.strategy, "notes": list(plan.notes)}
    result["in_force_before"] = in_force
    result["in_force_after"] = None if engine.heterogeneous_plan is None else engine.heterogeneous_plan.to_dict()
    return result


@pytest.mark.multiprocess
def test_the_engines_scheduling_api_returns_hand_computed_values():
    enabled, disabled = run_subcases(_engine_api, [dict(enabled=True), dict(enabled=False)], world_size=1,
                                     timeout=300)
    for (result, ), fork_on in ((enabled, True), (disabled, False)):
        # Datasheet scores (dense TFLOP/s): A100 bf16/fp16 312, V100 fp16 125 (no bf16), A100 fp32
        # 19.5; a measured score is taken as given.
        assert result["score_description"] == 312.0
        assert result["score_dict"] == 0.7
        assert result["score_v100_by_name"] == 125.0
        assert result["score_a100_fp32"] == 19.5
        # 312 + 125 + 63 = 500: 312 / 500, 125 / 500, 63 / 500.
        assert result["normalized"] == pytest.approx([0.624, 0.25, 0.126])
        # 12 samples per micro-step: 12 * (0.5, 0.25, 0.25) = 6, 3, 3 exactly.
        assert result["even_split"] == [6, 3, 3]
        # 12 samples at times per sample 1/0.6 and 1/0.4: [7, 5] takes max(11.7, 12.5) = 12.5, the
        # least of any split ([8, 4]: 13.3; [6, 6]: 15).
        assert result["remainder_split"] == [7, 5]
        # Time per micro-step = mbs / score. Splitting 12 between 312 and 125 TFLOP/s:
        #   [8, 4]: 8/312 = 0.0256, 4/125 = 0.0320 -> 0.0320
        #   [9, 3]: 9/312 = 0.0288, 3/125 = 0.0240 -> 0.0288  (the smallest slowest rank)
        #   [10, 2]: 10/312 = 0.0321, 2/125 = 0.0160 -> 0.0321
        assert result["scheduled"] == {"sizes": [9, 3], "gas": [GAS, GAS], "batch": TRAIN_BATCH,
                                       "strategy": "compute_aware", "notes": []}, result["scheduled"]
        # A device without a known speed: equal shares of 12 until profiling measures it.
        unknown = result["unknown"]
        assert unknown["sizes"] == [6, 6] and unknown["batch"] == TRAIN_BATCH, unknown
        assert unknown["notes"] == ["ranks [1] have no known speed: equal shares until profiling measures them"]
        # A plan for other devices is only returned: the plan in force stays.
        assert result["in_force_after"] == result["in_force_before"]
        if fork_on:
            assert result["in_force_before"]["micro_batch_sizes"] == [TRAIN_BATCH // GAS]
        else:
            assert result["in_force_before"] is None
