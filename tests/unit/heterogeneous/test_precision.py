# SPDX-License-Identifier: Apache-2.0
"""mixed_precision_support: the choice per cluster, the errors, and the engine following it."""

import re
from types import SimpleNamespace

import pytest

from deepspeed.runtime.heterogeneous.planning.precision import choose_precision
from harness import run_subcases


def device(rank, name, bf16, fp16):
    return SimpleNamespace(rank=rank, name=name, bf16=bf16, fp16=fp16)


A100, V100, OLD = (lambda r: device(r, "A100", True, True), lambda r: device(r, "V100", False, True),
                   lambda r: device(r, "K80", False, False))


def test_adaptive_picks_what_every_rank_supports():
    assert choose_precision("adaptive", [A100(0), A100(1)]).dtype == "bf16"
    mixed = choose_precision("adaptive", [A100(0), V100(1)])
    assert mixed.dtype == "fp16" and "rank 1 (V100) cannot run bf16" in mixed.reason
    assert "adaptive loss scaler" in mixed.reason
    assert choose_precision("adaptive", [A100(0), OLD(1)]).dtype == "fp32"
    assert choose_precision("config", [A100(0)]) is None


def test_conflicts_with_the_configs_blocks_are_named():
    choice = choose_precision("adaptive", [A100(0), V100(1)], bf16_enabled=True)
    assert choice.overridden.startswith("the config's bf16 block (bf16) is overridden")
    assert "'adaptive' wins" in choice.overridden
    assert choose_precision("adaptive", [A100(0), A100(1)], bf16_enabled=True).overridden is None
    assert "enables no half type" in choose_precision("bf16", [A100(0)]).overridden


@pytest.mark.parametrize("mode, devices, culprit", [("bf16", [A100(0), V100(1)], "rank 1 (V100) cannot run bf16"),
                                                    ("fp16", [OLD(0), A100(1)], "rank 0 (K80) cannot run fp16")])
def test_forced_type_a_rank_lacks_is_an_error(mode, devices, culprit):
    with pytest.raises(ValueError, match=re.escape(f"mixed_precision_support '{mode}' is forced but {culprit}")):
        choose_precision(mode, devices)


def _initialize(rank, world_size, mode):
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 4, "fp16": {"enabled": mode == "adaptive"},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform",
                                       "mixed_precision_support": mode}}
    accelerator = get_accelerator()
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as exc:
        return {"error": str(exc), "fp16_supported": bool(accelerator.is_fp16_supported())}
    return {"bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
            "bf16_supported": bool(accelerator.is_bf16_supported()),
            "fp16_supported": bool(accelerator.is_fp16_supported())}


def _zero_init(rank, world_size):
    """A ZeRO-3 model built under ``zero.Init`` before the engine (as transformers builds one):
    ``zero.Init`` coordinates its config, so its parameters take the precision the fork chose from
    the gathered devices, the one the engine then trains in."""
    import deepspeed
    import torch

    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform",
                                       "mixed_precision_support": "adaptive"}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Linear(4, 4)
    init_dtype = str(model.weight.ds_tensor.dtype)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return {"init": init_dtype, "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled()}


@pytest.mark.multiprocess
def test_zero_init_partitions_in_the_chosen_type():
    for result in run_subcases(_zero_init, [{}], world_size=2, timeout=300)[0]:
        # The CPU accelerator supports bf16 and the config enables no half type: adaptive picks bf16.
        assert result == {"init": "torch.bfloat16", "bf16": True, "fp16": False}, result


@pytest.mark.multiprocess
def test_engine_trains_in_the_chosen_type():
    adaptive, forced_fp16 = run_subcases(_initialize, [dict(mode="adaptive"), dict(mode="fp16")], world_size=2,
                                         timeout=300)
    for result in adaptive:
        # The CPU accelerator supports bf16: adaptive overrides the config's fp16 block.
        assert result["bf16_supported"] and result["bf16"] and not result["fp16"], result
    for result in forced_fp16:
        if result["fp16_supported"]:
            assert result.get("fp16"), result
        else:  # oneDNN without fp16 kernels: the forced type is refused at initialize, naming the rank
            assert "mixed_precision_support 'fp16' is forced but rank 0" in result["error"], result


def test_the_choice_is_written_into_the_config_before_upstream_parses_it():
    from deepspeed.runtime.heterogeneous.planning.precision import choose_precision_for_config

    user = {"fp16": {"enabled": False, "initial_scale_power": 12}, "bfloat16": {"enabled": True}}
    param_dict = dict(user)
    choice = choose_precision_for_config("adaptive", [A100(0), V100(1)], param_dict)
    assert choice.dtype == "fp16" and "overridden" in choice.overridden
    assert param_dict["fp16"] == {"enabled": True, "initial_scale_power": 12, "auto_scale_threshold": 0.95}
    assert param_dict["bfloat16"] == {"enabled": False} and "bf16" not in param_dict  # the key the user wrote
    assert user["fp16"] == {"enabled": False, "initial_scale_power": 12}  # the user's blocks are not modified
    # ZeRO-1/2 with the optimizer offloaded gets it too (its ranks measure their partitions on the host).
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    choose_precision_for_config("adaptive", [A100(0), V100(1)], offloaded)
    assert offloaded["fp16"] == {"enabled": True, "auto_scale_threshold": 0.95}
    assert choose_precision_for_config("config", [A100(0)], {}) is None


def test_the_adaptive_scaler_is_accepted_with_every_zero_stage_and_optimizer_offload():
    from deepspeed.runtime.config import DeepSpeedConfig

    base = {"train_batch_size": 2, "fp16": {"enabled": True, "auto_scale_threshold": 0.9}}
    for zero in ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, {"stage": 2},
                 {"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"stage": 3, "offload_optimizer": {"device": "cpu"}}):
        assert DeepSpeedConfig({**base, "zero_optimization": zero}).float16_config.auto_scale_threshold == 0.9
