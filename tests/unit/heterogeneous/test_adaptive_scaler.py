# SPDX-License-Identifier: Apache-2.0
"""The adaptive loss scaler's policy, its configuration, and its use in ZeRO 1-3 training."""

import math
import pickle
import random

import pytest
import torch

from deepspeed.runtime.fp16.adaptive_scaler import (FP16_MAX, HISTORY, MARGIN_DECAY_WINDOWS, MARGIN_RECOVERY_STEPS,
                                                    MAX_SCALE, OVERFLOW_BURST_STEPS, AdaptiveLossScaler,
                                                    next_power_of_two_scale)
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
from harness import run_subcases


def make_scaler(threshold=0.95, init_scale=2.0**16, min_scale=1.0):
    return AdaptiveLossScaler(threshold, init_scale=init_scale, scale_window=1000, min_scale=min_scale,
                              delayed_shift=1, consecutive_hysteresis=False)


def step(scaler, unscaled_max_abs=None, overflow=False):
    """One optimizer step as the ZeRO optimizers drive the scaler."""
    scaled = float("inf") if overflow else unscaled_max_abs * scaler.cur_scale
    reported = scaler.observe(torch.tensor([1.0 if overflow else 0.0, scaled]))
    assert reported == overflow
    scaler.update_scale(reported)
    return scaler.cur_scale


def test_next_scale_is_the_power_of_two_under_the_threshold():
    assert next_power_of_two_scale(1.0, 0.95, 1.0) == 2.0**15  # 0.95 * 65504 = 62228.8 -> 2**15
    assert next_power_of_two_scale(1e-3, 0.95, 1.0) == MAX_SCALE  # 2**25 would fit; clamped at 2**24
    assert next_power_of_two_scale(1e6, 0.95, 0.25) == 0.25  # clamped at the minimum
    assert next_power_of_two_scale(0.0, 0.95, 1.0) == MAX_SCALE  # all-zero gradients
    for peak in (3e-3, 0.1, 7.0, 1234.5):
        scale = next_power_of_two_scale(peak, 0.95, 2.0**-24)
        assert peak * scale <= 0.95 * FP16_MAX < peak * scale * 2


def test_scale_follows_the_gradients_and_a_quiet_step_does_not_raise_it():
    scaler = make_scaler()
    assert step(scaler, 0.5) == 2.0**16  # 0.95 * 65504 / 0.5 = 124457 -> 2**16
    assert step(scaler, 1e-4) == 2.0**16  # the peak of the history (0.5) still rules
    for _ in range(HISTORY - 1):
        step(scaler, 1e-4)
    # Once the large value has left the window, the scale rises to what the gradients allow.
    assert scaler.cur_scale == next_power_of_two_scale(1e-4, 0.95, 1.0)


def test_overflow_skips_backs_off_and_is_not_repeated():
    scaler = make_scaler(init_scale=2.0**20)
    assert step(scaler, overflow=True) == 2.0**19
    # A clean step with small gradients must not send the scale back to the value that overflowed.
    for _ in range(HISTORY - 1):
        assert step(scaler, 1e-3) < 2.0**20


def test_an_overflow_the_gradients_did_not_predict_teaches_a_bounded_margin():
    scaler = make_scaler()
    peak = 0.5
    step(scaler, peak)
    chosen = scaler.cur_scale  # peak * chosen <= 0.95 * 65504
    step(scaler, overflow=True)  # ...yet the backward overflowed (an activation gradient, a spike)
    assert scaler.margin == 2 and scaler.cur_scale == chosen / 2  # one halving, not more
    for _ in range(3 * OVERFLOW_BURST_STEPS):  # long after the overflow, the same gradients
        assert step(scaler, peak) == chosen / 2
    # A lone overflow at a margin that has held is a spike: the step is skipped, the margin stays.
    assert step(scaler, overflow=True) == chosen / 4
    assert step(scaler, peak) == chosen / 2
    # Another overflow this soon proves the margin short: a second level, which goes again after
    # MARGIN_RECOVERY_STEPS clean steps.
    step(scaler, overflow=True)
    for _ in range(MARGIN_RECOVERY_STEPS - 1):
        assert step(scaler, peak) == chosen / 4
    assert step(scaler, peak) == chosen / 2
    # The higher scale overflows again at once: a systematic factor, re-tested half as often.
    step(scaler, overflow=True)
    for _ in range(2 * MARGIN_RECOVERY_STEPS - 1):
        assert step(scaler, peak) == chosen / 4
    assert step(scaler, peak) == chosen / 2
    # The first level goes after MARGIN_DECAY_WINDOWS loss-scale windows of clean steps.
    scaler.scale_window = 3
    for _ in range(MARGIN_DECAY_WINDOWS * 3 - 1):
        assert step(scaler, peak) == chosen / 2
    assert step(scaler, peak) == chosen and scaler.margin == 1


def test_overflow_after_all_zero_gradients_backs_off():
    scaler = make_scaler()
    assert step(scaler, 0.0) == MAX_SCALE  # nothing measured to protect
    assert step(scaler, overflow=True) == MAX_SCALE / 2  # no peak to compare with: a bound, not a margin
    assert step(scaler, 0.0) < MAX_SCALE


def test_threshold_one_never_returns_to_an_overflowing_scale():
    scaler = make_scaler(threshold=1.0, init_scale=2.0**10)
    step(scaler, overflow=True)
    assert step(scaler, 1e-6) < 2.0**10


def test_minimum_scale_error_names_the_history():
    scaler = make_scaler(init_scale=2.0, min_scale=1.0)
    assert step(scaler, 5e4) == 1.0  # gradients this large leave only the minimum scale
    with pytest.raises(Exception, match=r"Current loss scale already at minimum.*recent un-scaled gradient max-abs"):
        step(scaler, overflow=True)


def test_state_survives_pickling_as_zero_checkpoints_store_it():
    scaler = make_scaler()
    for value in (0.5, 0.25, 2.0):
        step(scaler, value)
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_summary() == scaler.state_summary()
    assert step(restored, 0.1) == step(scaler, 0.1)
    # A saved scaler without the recovery state (an older checkpoint's) loads and runs on.
    del scaler.__dict__["_recovery_steps"], scaler.__dict__["_lowered"]
    restored = pickle.loads(pickle.dumps(scaler))
    assert step(restored, overflow=True) and step(restored, 0.1) == scaler.cur_scale / 2


def test_config_selects_the_scaler_and_rejects_bad_values():
    args = DeepSpeedFP16Config(enabled=True, auto_scale_threshold=0.9).dynamic_loss_scale_args()
    assert isinstance(CreateLossScaler(torch.half, 0, True, args), AdaptiveLossScaler)
    plain = DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args()
    assert type(CreateLossScaler(torch.half, 0, True, plain)) is DynamicLossScaler
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"fp16.auto_scale_threshold.*\(0, 1\]"):
            DeepSpeedFP16Config(enabled=True, auto_scale_threshold=bad)
    with pytest.raises(ValueError, match="contradicts the static fp16.loss_scale 128"):
        DeepSpeedFP16Config(enabled=True, auto_scale_threshold=0.95, loss_scale=128)


# -- long runs: what overflows cost over 10,000 steps (pure, no processes) -------------------------

LONG_RUN = 10_000
WARM_UP = 100


def shrinking_gradients(seed):
    """Un-scaled gradient max-abs per step: three decades down over the run (training converging,
    the case where a scale stuck low loses the most resolution), with +-25% noise step to step."""
    generator = random.Random(seed)
    return [10.0 * 1e-3**(index / LONG_RUN) * generator.uniform(0.8, 1.25) for index in range(LONG_RUN)]


def ideal_scale(max_abs, threshold=0.95):
    """The largest power of two that keeps ``max_abs`` within ``threshold`` of fp16's range."""
    return 2.0**math.floor(math.log2(threshold * FP16_MAX / max_abs))


def run_long(scaler, gradients, overflows, ideal):
    """Drive ``scaler`` through the run; ``overflows(index, scale, max_abs)`` says whether that step's
    backward overflowed. Returns the steps after warm-up whose scale was off the ideal by more than 4x,
    and the number of skipped steps."""
    off, skipped = 0, 0
    for index, max_abs in enumerate(gradients):
        scale = scaler.cur_scale  # the scale this step's backward runs with
        if index >= WARM_UP and not ideal(max_abs) / 4 <= scale <= ideal(max_abs) * 4:
            off += 1
        overflow = overflows(index, scale, max_abs)
        skipped += overflow
        step(scaler, None if overflow else max_abs, overflow=overflow)
    return off, skipped


def test_rare_unpredicted_overflows_do_not_ratchet_the_scale_down():
    # A spike the measured gradients could not predict (a bad batch, an activation gradient) about
    # once in 200 steps: each costs its skipped step and a bounded back-off, not a permanent halving.
    spikes = random.Random(7)
    injected = [spikes.random() < 1 / 200 for _ in range(LONG_RUN)]
    off, skipped = run_long(make_scaler(), shrinking_gradients(3), lambda index, scale, max_abs: injected[index],
                            ideal_scale)
    assert skipped == sum(injected) >= 30
    assert off <= 0.01 * (LONG_RUN - WARM_UP), off


def test_a_systematic_unseen_factor_is_learned_without_probing_often():
    # The backward's largest value is always 3x the measured parameter-gradient max-abs: the scale
    # must settle where that fits and re-test a higher one ever more rarely, not every few steps
    # (re-testing every 16 clean steps skipped 549 steps here).
    factor = 3.0
    off, skipped = run_long(make_scaler(), shrinking_gradients(5),
                            lambda index, scale, max_abs: scale * max_abs * factor > FP16_MAX,
                            lambda max_abs: ideal_scale(max_abs * factor))
    assert skipped <= 50, skipped
    assert off <= 0.01 * (LONG_RUN - WARM_UP), off


def test_an_intermittent_unseen_factor_keeps_one_halving():
    # One step in 30 the backward's largest value is 1.5-3x the measured peak: at the measured ideal
    # that overflows every few dozen steps (as the small GPT of tests/perf/bench_loss_scaling.py
    # does), one halving below it rarely. A margin dropped 16 clean steps after each overflow
    # skipped 185 steps here.
    factors = random.Random(11)
    unseen = [factors.uniform(1.5, 3.0) if factors.random() < 1 / 30 else 1.0 for _ in range(LONG_RUN)]
    off, skipped = run_long(make_scaler(), shrinking_gradients(13),
                            lambda index, scale, max_abs: scale * max_abs * unseen[index] > FP16_MAX, ideal_scale)
    assert skipped <= 60, skipped
    assert off <= 0.01 * (LONG_RUN - WARM_UP), off


# -- in training: ZeRO 1-3, fp16, two ranks ------------------------------------------------------

WIDTH = 32
THRESHOLD = 0.95


def make_model():
    torch.manual_seed(9)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))


def batches(steps, batch=8):
    generator = torch.Generator().manual_seed(4)
    return [(torch.randn(batch, WIDTH, generator=generator), torch.randn(batch, WIDTH, generator=generator))
            for _ in range(steps)]


def reference_first_step_max_abs():
    """The un-scaled gradient max-abs of the first global batch (fp32, one process)."""
    model = make_model()
    inputs, targets = batches(1)[0]
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return max(p.grad.abs().max().item() for p in model.parameters())


def fp16_config(stage, offload=False):
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_batch_size": 8, "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "fp16": {"enabled": True, "auto_scale_threshold": THRESHOLD, "initial_scale_power": 16}}


def allow_fp16_on_cpu():
    """The CPU accelerator reports fp16 only where oneDNN has fp16 kernels; torch's own CPU kernels
    run fp16 everywhere (slower), which is all these small models need."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def adaptive_scaler_of(engine):
    """ZeRO 1-3 optimizers hold their scaler as ``loss_scaler``; the ZeRO-0 fp16 optimizers keep
    upstream's scale bookkeeping and hold the adaptive one beside it."""
    return getattr(engine.optimizer, "adaptive_scaler", None) or engine.optimizer.loss_scaler


def train_fp16(rank, world_size, stage, checkpoint_dir, offload=False):
    import deepspeed

    allow_fp16_on_cpu()

    def parameters(engine):
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            return [p.detach().float().clone() for p in engine.module.parameters()]

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=fp16_config(stage, offload))
    scaler = adaptive_scaler_of(engine)
    assert isinstance(scaler, AdaptiveLossScaler)
    scales, skipped = [], []
    for index, (inputs, targets) in enumerate(batches(5)):
        mine = slice(rank * 4, rank * 4 + 4)
        before = parameters(engine)
        loss = torch.nn.functional.mse_loss(engine(inputs[mine].half()).float(), targets[mine])
        if index == 2 and rank == 1:
            loss = loss * float("inf")  # one rank overflows: every rank must skip the step
        engine.backward(loss)
        engine.step()
        scales.append(scaler.cur_scale)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, parameters(engine))))
    engine.save_checkpoint(checkpoint_dir, tag="adaptive")
    summary = scaler.state_summary()
    model = make_model()
    fresh, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=fp16_config(stage, offload))
    fresh.load_checkpoint(checkpoint_dir, tag="adaptive")
    return {"scales": scales, "skipped": skipped, "summary": summary,
            "restored": adaptive_scaler_of(fresh).state_summary()}


@pytest.mark.multiprocess
def test_adaptive_scaler_in_zero_stages(tmp_path):
    # ZeRO-1/2 with the optimizer offloaded measure the fp32 gradient partitions on the host.
    cases = [dict(stage=stage, checkpoint_dir=str(tmp_path / f"z{stage}")) for stage in (0, 1, 2, 3)]
    cases += [dict(stage=stage, checkpoint_dir=str(tmp_path / f"z{stage}-offload"), offload=True) for stage in (1, 2)]
    target = THRESHOLD * FP16_MAX / reference_first_step_max_abs()
    for case, (first, second) in zip(cases, run_subcases(train_fp16, cases, world_size=2, timeout=600)):
        assert first["scales"] == second["scales"], case  # one scale for all ranks
        # After the first step the scale is the power of two just under the threshold; ZeRO-0
        # all-reduces fp16 gradients as a sum over the 2 ranks, which must fit too.
        bound = target / (2 if case["stage"] == 0 else 1)
        assert bound / 2 * 0.99 < first["scales"][0] <= bound * 1.01, (case, first["scales"], bound)
        assert first["skipped"] == second["skipped"] == [False, False, True, False, False], case
        assert first["scales"][2] == first["scales"][1] / 2, case  # the overflow halved the scale
        assert first["summary"] == first["restored"], case  # checkpoints keep the history


# -- one rank offloaded, one not: the same [overflow, max-abs] on both ----------------------------


def _mixed_config(stage, rank_1_offloads):
    """The fork on, fp16 with the adaptive scaler, ZeRO ``stage``; rank 1's emulated memory holds its
    even shard only with its optimizer state on the host (``rank_1_offloads``), or all of it."""
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from test_rank_offload import _peak

    # The predicted peaks (memory_peak) of rank 1 with its optimizer state offloaded and not.
    offloaded, even = (_peak(make_model(), stage, fraction, bf16=True) for fraction in (1.0, 0.0))
    memory = [1.0, (offloaded + 0.9 * (even - offloaded) if rank_1_offloads else 1.0 * BYTES_PER_GB) / BYTES_PER_GB]
    config = fp16_config(stage)
    config["zero_optimization"]["heterogeneous_offload"] = {"cpu_offload": True}
    config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": [4, 4],
                                      "emulation": {"memory_gb": memory, "mode": "dilation"}}
    config["heterogeneous_memory"] = {"enabled": True, "zero_partitions": "even", "hbm_utilization_threshold": 1.0}
    return config


def train_fp16_mixed(rank, world_size, stage, rank_1_offloads):
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    allow_fp16_on_cpu()
    model = make_model()
    scales = []
    with recording() as entries:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_mixed_config(stage, rank_1_offloads))
        for index, (inputs, targets) in enumerate(batches(5)):
            mine = slice(rank * 4, rank * 4 + 4)
            loss = torch.nn.functional.mse_loss(engine(inputs[mine].half()).float(), targets[mine])
            if index == 2 and rank == 0:
                loss = loss * float("inf")  # the rank on the device overflows: the offloaded one skips too
            engine.backward(loss)
            engine.step()
            scales.append(adaptive_scaler_of(engine).cur_scale)
    master = torch.cat([p.detach().float().cpu().flatten() for p in engine.optimizer.single_partition_of_fp32_groups])
    return {"scales": scales, "entries": list(entries), "offloaded": list(engine._config.heterogeneous.offloaded_ranks),
            "master": master, "params": [p.detach().float().clone() for p in engine.module.parameters()]}


@pytest.mark.multiprocess
def test_adaptive_scaler_with_one_rank_offloaded_keeps_one_scale_and_one_collective_sequence():
    from deepspeed.runtime.heterogeneous.measure.collective_log import assert_same_collectives

    cases = [dict(stage=stage, rank_1_offloads=offloads) for stage in (1, 2) for offloads in (True, False)]
    results = run_subcases(train_fp16_mixed, cases, world_size=2, timeout=600)
    target = THRESHOLD * FP16_MAX / reference_first_step_max_abs()
    for (case, (first, second)), (_, (device_first, device_second)) in zip(
            list(zip(cases, results))[::2], list(zip(cases, results))[1::2]):
        assert first["offloaded"] == second["offloaded"] == [1], case
        assert device_first["offloaded"] == device_second["offloaded"] == [], case
        assert_same_collectives([first["entries"], second["entries"]], what=str(case))
        # One scale on both ranks, measured: the power of two just under the threshold after the
        # first step, halved by rank 0's overflow; the same as with both ranks on the device.
        assert first["scales"] == second["scales"] == device_first["scales"], case
        assert target / 2 * 0.99 < first["scales"][0] <= target * 1.01, (case, first["scales"], target)
        assert first["scales"][2] == first["scales"][1] / 2, case
        # The same training: rank 1's fp32 master partition, on the host, equals the device run's.
        torch.testing.assert_close(second["master"], device_second["master"], rtol=0, atol=1e-6)
        for got, want in zip(first["params"], device_first["params"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
