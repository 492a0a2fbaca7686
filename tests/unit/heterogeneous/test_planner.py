# SPDX-License-Identifier: Apache-2.0
"""The planner: time models, exact integer splits, memory limits, manual plans, prior-score helpers (pure logic)."""

import itertools
import json
import random

import pytest

from deepspeed.runtime.heterogeneous.measure.devices import DeviceDescription
from deepspeed.runtime.heterogeneous.planning.planner import (Plan, TimeModel, device_score, distribute_workload,
                                                              fit_time_model, plan_micro_batches,
                                                              plausible_time_model, schedule_heterogeneous_tasks,
                                                              time_models_from_scores)


def _slowest(models, sizes, steps=None):
    steps = steps or [1] * len(sizes)
    return max(g * model.micro_step_time(m) for model, m, g in zip(models, sizes, steps))


def _brute_force_best(models, units, caps):
    """The smallest achievable slowest-rank time over every integer split (small cases only)."""
    ranges = [range(1, min(cap or units, units) + 1) for cap in caps[:-1]]
    best = None
    for head in itertools.product(*ranges):
        last = units - sum(head)
        if 1 <= last <= (caps[-1] or units):
            time_taken = _slowest(models, list(head) + [last])
            best = time_taken if best is None else min(best, time_taken)
    return best


# Time models


def test_time_model_validates_and_predicts():
    assert TimeModel(0.5, 0.25).micro_step_time(4) == 1.5
    for a, b in [(-0.1, 1.0), (0.0, 0.0), (0.0, -1.0), (float("nan"), 1.0), (0.0, float("inf"))]:
        with pytest.raises(ValueError, match="TimeModel"):
            TimeModel(a, b)


def test_fit_time_model_recovers_exact_line_and_handles_noise():
    model = fit_time_model([(m, 0.02 + 0.005 * m) for m in (2, 4, 8)])
    assert model.a == pytest.approx(0.02) and model.b == pytest.approx(0.005)
    rng = random.Random(0)
    noisy = [(m, (0.03 + 0.004 * m) * rng.uniform(0.97, 1.03)) for m in (2, 4, 6, 8, 12, 16) for _ in range(5)]
    model = fit_time_model(noisy)
    assert model.a == pytest.approx(0.03, rel=0.25) and model.b == pytest.approx(0.004, rel=0.1)


def test_fit_time_model_single_size_and_fallbacks():
    single = fit_time_model([(4, 0.2), (4, 0.4)])
    assert single.a == 0.0 and single.b == pytest.approx(0.075)
    # Time that shrinks with the batch (noise) or a negative intercept: proportional fit through the origin.
    for samples in ([(2, 0.5), (8, 0.4)], [(2, 0.1), (4, 0.5)]):
        model = fit_time_model(samples)
        assert model.a == 0.0 and model.b > 0


@pytest.mark.parametrize("samples, message", [
    ([], "no samples"),
    ([(4, 0.1), (8, )], r"samples\[1\].*not a"),
    ([(0, 0.1)], r"samples\[0\].*positive"),
    ([(4, -1.0)], r"samples\[0\].*positive"),
    ([(4, float("nan"))], r"samples\[0\]"),
])
def test_fit_time_model_rejects_bad_samples(samples, message):
    with pytest.raises(ValueError, match=message):
        fit_time_model(samples)


def test_implausible_fixed_cost_falls_back_to_proportional_time():
    noisy = TimeModel(0.748, 0.0252)  # measured at 8 samples: 0.95 s, 79% of it "fixed"
    fallback = plausible_time_model(noisy, 8)
    assert fallback.a == 0.0 and fallback.b == pytest.approx((0.748 + 8 * 0.0252) / 8)
    sound = TimeModel(0.1, 0.03)
    assert plausible_time_model(sound, 24) is sound and plausible_time_model(noisy, None) is noisy


def test_a_flat_fit_makes_rebalancing_a_slowed_rank_look_useless():
    """Two equal ranks timed at 9 and 7 samples on a loaded machine: ~0.1 s either way. The fit
    calls nearly all of it fixed cost. When rank 1 then slows 3x, under that fit no split gains
    the rebalancing threshold (and the planner's pick, [15, 1], overshoots: with equal cost for
    every split it takes the extreme); the plausible model predicts the real gain and the ideal
    split."""
    samples = [(9, 0.100), (7, 0.099), (9, 0.1005), (7, 0.0985)]
    flat = fit_time_model(samples)
    assert flat.a > 0.9 * flat.micro_step_time(8)
    gains, plans = {}, {}
    for name, model in {"flat": flat, "plausible": plausible_time_model(flat, 8)}.items():
        slowed = TimeModel(3 * model.a, 3 * model.b)
        current = max(model.micro_step_time(9), slowed.micro_step_time(7))
        best = plan_micro_batches([model, slowed], train_batch_size=16)
        gains[name], plans[name] = 1 - best.predicted_step_time / current, best.micro_batch_sizes
    assert gains["flat"] < 0.1 and plans["flat"] == (15, 1)
    assert gains["plausible"] > 0.4 and plans["plausible"] == (12, 4)


def test_time_models_from_scores():
    assert time_models_from_scores([2.0, 0.5]) == [TimeModel(0.0, 0.5), TimeModel(0.0, 2.0)]
    with pytest.raises(ValueError, match=r"scores\[1\]"):
        time_models_from_scores([1.0, 0.0])


# compute_aware


def test_compute_aware_is_exact_and_proportional_for_pure_throughput():
    plan = plan_micro_batches(time_models_from_scores([1.0, 0.4]), 256, gradient_accumulation_steps=2)
    assert plan.micro_batch_sizes == (92, 36) and plan.gradient_accumulation_steps == (2, 2)
    assert sum(plan.micro_batch_sizes) * 2 == 256 and plan.strategy == "compute_aware"
    assert plan.predicted_step_time == pytest.approx(2 * 92)  # 91/37 would take 2 * 37 / 0.4 = 185


def test_compute_aware_breaks_ties_towards_lower_ranks():
    same = [TimeModel(0.1, 1.0)] * 3
    assert plan_micro_batches(same, 8).micro_batch_sizes == (3, 3, 2)
    assert plan_micro_batches(same, 10).micro_batch_sizes == (4, 3, 3)


def test_compute_aware_matches_brute_force_on_small_cases():
    rng = random.Random(1234)
    for _ in range(300):
        world = rng.choice([2, 3])
        models = [TimeModel(rng.choice([0.0, rng.uniform(0, 2)]), rng.uniform(0.1, 3)) for _ in range(world)]
        units = rng.randint(world, 24)
        caps = [rng.choice([None, rng.randint(1, 12)]) for _ in range(world)]
        if sum(cap or units for cap in caps) < units:
            continue
        plan = plan_micro_batches(models, units, max_micro_batch=caps)
        sizes = plan.micro_batch_sizes
        assert sum(sizes) == units
        assert all(1 <= m <= (cap or units) for m, cap in zip(sizes, caps))
        assert plan.predicted_step_time == pytest.approx(_brute_force_best(models, units, caps), rel=1e-12)


def test_compute_aware_respects_memory_caps():
    models = time_models_from_scores([4.0, 1.0, 1.0])
    plan = plan_micro_batches(models, 60, max_micro_batch=[10, None, None])
    assert plan.micro_batch_sizes == (10, 25, 25)
    assert plan_micro_batches(models, 60, max_micro_batch=[10.7, float("inf"), None]).micro_batch_sizes == (10, 25, 25)


def test_rank_that_cannot_hold_one_sample_is_named():
    with pytest.raises(ValueError, match=r"rank 1 \(V100\) cannot train: its memory limit allows 0 samples"):
        plan_micro_batches(time_models_from_scores([1, 1]), 8, max_micro_batch=[8, 0], device_names=["A100", "V100"])


def test_total_capacity_below_the_batch_says_so_and_suggests_gas():
    with pytest.raises(ValueError) as error:
        plan_micro_batches(time_models_from_scores([1, 1]), 64, max_micro_batch=[10, 12])
    message = str(error.value)
    assert "allow 22 samples per micro-step" in message and "64 / gradient_accumulation_steps 1 = 64" in message
    assert "gradient_accumulation_steps 4 would fit" in message


def test_plans_4096_ranks():
    """How long it takes is tests/perf/bench_planner.py's (target: under 1 s)."""
    rng = random.Random(7)
    models = [TimeModel(rng.uniform(0, 0.05), rng.uniform(0.5, 4.0)) for _ in range(4096)]
    caps = [rng.choice([None, rng.randint(8, 64)]) for _ in models]
    for allow_per_rank_gas in (False, True):
        plan = plan_micro_batches(models, 4096 * 40 + 1234, max_micro_batch=caps, allow_per_rank_gas=allow_per_rank_gas)
        assert sum(plan.samples_per_rank) == 4096 * 40 + 1234
        assert all(m <= (cap or m) for m, cap in zip(plan.micro_batch_sizes, caps))


# Per-rank gradient accumulation


def test_per_rank_gas_only_when_memory_forces_it():
    models = time_models_from_scores([1.0, 0.4])
    unlimited = plan_micro_batches(models, 256, 2, allow_per_rank_gas=True)
    assert not unlimited.per_rank_gas and unlimited.notes == ()
    capped = plan_micro_batches(models, 256, 2, max_micro_batch=[40, None], allow_per_rank_gas=True)
    equal = plan_micro_batches(models, 256, 2, max_micro_batch=[40, None])
    assert capped.per_rank_gas and not equal.per_rank_gas
    assert capped.micro_batch_sizes[0] <= 40 and capped.gradient_accumulation_steps[0] % 2 == 0
    assert sum(capped.samples_per_rank) == 256
    assert capped.predicted_step_time < 0.5 * equal.predicted_step_time
    assert "per-rank gradient accumulation: ranks 0" in capped.notes[0]


def _brute_force_per_rank_gas(models, batch, gas, caps):
    """Two ranks: the best slowest-rank time over every (micro-steps, size) pair per rank."""
    units, best_for = batch // gas, []
    for model, cap in zip(models, caps):
        times = {}
        for steps in range(1, units + 1):
            for size in range(1, min(cap or units, units // steps) + 1):
                time_taken = gas * steps * model.micro_step_time(size)
                times[steps * size] = min(times.get(steps * size, time_taken), time_taken)
        best_for.append(times)
    return min(max(t, best_for[1][units - n]) for n, t in best_for[0].items() if units - n in best_for[1])


@pytest.mark.parametrize("models, batch, gas, caps, slack", [
    ([TimeModel(0.01, 0.01), TimeModel(0.01, 0.025)], 256, 2, [40, None], 1.0),
    ([TimeModel(0.05, 0.01), TimeModel(0.02, 0.03)], 512, 1, [64, 128], 1.0),
    ([TimeModel(0.0, 1.0), TimeModel(0.0, 2.5)], 256, 2, [40, None], 1.0),
    ([TimeModel(0.1, 0.02), TimeModel(0.1, 0.05)], 96, 1, [16, 16], 1.1),  # whole micro-batches cost a little
])
def test_per_rank_gas_is_near_the_brute_force_optimum(models, batch, gas, caps, slack):
    plan = plan_micro_batches(models, batch, gas, max_micro_batch=caps, allow_per_rank_gas=True)
    assert plan.per_rank_gas
    assert plan.predicted_step_time <= slack * _brute_force_per_rank_gas(models, batch, gas, caps) * (1 + 1e-12)


def test_per_rank_gas_plans_are_valid_on_random_cases():
    rng = random.Random(99)
    for _ in range(300):
        world = rng.randint(1, 5)
        gas = rng.choice([1, 2, 3])
        models = [TimeModel(rng.choice([0.0, rng.uniform(0, 1)]), rng.uniform(0.1, 3)) for _ in range(world)]
        batch = gas * rng.randint(world, 60)
        caps = [rng.choice([None, rng.randint(1, 9)]) for _ in range(world)]
        plan = plan_micro_batches(models, batch, gas, max_micro_batch=caps, allow_per_rank_gas=True)
        assert sum(plan.samples_per_rank) == batch
        assert all(m <= (cap or m) for m, cap in zip(plan.micro_batch_sizes, caps))
        assert all(g % gas == 0 for g in plan.gradient_accumulation_steps)
        if sum(cap or batch for cap in caps) * gas >= batch:  # an equal-gas plan exists: never worse than it
            equal = plan_micro_batches(models, batch, gas, max_micro_batch=caps)
            assert plan.predicted_step_time <= equal.predicted_step_time


def test_per_rank_gas_rescues_a_batch_that_does_not_fit_equal_gas():
    models = time_models_from_scores([1.0, 1.0])
    with pytest.raises(ValueError, match="memory limits allow 8 samples"):
        plan_micro_batches(models, 17, max_micro_batch=[4, 4])
    plan = plan_micro_batches(models, 17, max_micro_batch=[4, 4], allow_per_rank_gas=True)
    assert sum(plan.samples_per_rank) == 17 and max(plan.micro_batch_sizes) <= 4


# uniform, manual and input errors


def test_uniform_split_and_its_error():
    plan = plan_micro_batches(time_models_from_scores([1.0, 0.4]), 32, 2, strategy="uniform")
    assert plan.micro_batch_sizes == (8, 8) and plan.predicted_rank_times == (16.0, 40.0)
    with pytest.raises(ValueError) as error:
        plan_micro_batches(time_models_from_scores([1, 1, 1]), 100, 2, strategy="uniform")
    assert "3 data-parallel ranks do not divide" in str(error.value) and "96 or 102" in str(error.value)


def test_fixed_plans_note_memory_limits_they_exceed():
    plan = plan_micro_batches(time_models_from_scores([1, 1]), 16, strategy="uniform", max_micro_batch=[4, None])
    assert plan.notes == ("rank 0: micro-batch 8 exceeds its predicted memory limit of 4 samples", )


def test_manual_list_and_map():
    models = time_models_from_scores([1, 1, 1])
    plan = plan_micro_batches(models, 32, 2, strategy="manual", manual=[8, 5, 3])
    assert plan.micro_batch_sizes == (8, 5, 3) and plan.strategy == "manual"
    names = ["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB", "Tesla V100-SXM2-32GB"]
    by_name = {"NVIDIA A100-SXM4-80GB": 8, "tesla v100-sxm2-32gb": 4}
    plan = plan_micro_batches(models, 16, strategy="manual", manual=by_name, device_names=names)
    assert plan.micro_batch_sizes == (8, 4, 4)


@pytest.mark.parametrize("manual, names, message", [
    ([8, 8], None, "has 2 entries but the data-parallel world has 3 ranks"),
    ([8, 0, 8], None, r"micro_batch_sizes\[1\] = 0 must be a positive integer"),
    ([8, -2, 10], None, r"micro_batch_sizes\[1\] = -2"),
    ([8, 4, 3], None, "sum to 15 per micro-step.*15 \\* gradient_accumulation_steps 1 = 15.*must sum to 16"),
    ({"A100": 8}, None, "need the ranks' device names"),
    ({"A100": 8, "V100": 4}, ["A100", "V100", "T4"], "rank 2 has device 'T4'.*names given: \\['A100', 'V100'\\]"),
    ({"A100": 8, "T4": 0}, ["A100", "T4", "T4"], r"micro_batch_sizes\['T4'\] \(rank 1\)"),
])
def test_manual_errors(manual, names, message):
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(time_models_from_scores([1, 1, 1]), 16, strategy="manual", manual=manual, device_names=names)


@pytest.mark.parametrize("kwargs, message", [
    (dict(train_batch_size=30, gradient_accumulation_steps=4), "train_batch_size 30 is not divisible by "
     "gradient_accumulation_steps 4"),
    (dict(train_batch_size=2), "2 samples per micro-step cannot give each of the 3"),
    (dict(train_batch_size=0), "train_batch_size = 0 must be a positive integer"),
    (dict(train_batch_size=30, strategy="fastest"), "'fastest' is not a registered load-balancing strategy; "
     "registered: 'compute_aware', 'manual', 'uniform'"),
    (dict(train_batch_size=30, manual=[10, 10, 10]), "not read by strategy 'compute_aware'; strategies that read "
     "them: manual"),
    (dict(train_batch_size=30, max_micro_batch=[1, 2]), "max_micro_batch has 2 entries for 3"),
    (dict(train_batch_size=30, device_names=["a"]), "device_names has 1 entries for 3"),
])
def test_input_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(time_models_from_scores([1, 1, 1]), **kwargs)


# The plan object


def test_plan_weights_round_trip_and_table():
    plan = plan_micro_batches(time_models_from_scores([1.0, 0.4]), 16, 2, strategy="manual", manual=[5, 3])
    assert plan.loss_weights == pytest.approx((2 * 5 / 8, 2 * 3 / 8))
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    per_rank = Plan((4, 2), (1, 3), 10, "compute_aware", (4.0, 6.0))
    assert per_rank.samples_per_rank == (4, 6) and per_rank.loss_weights == pytest.approx((0.8, 1.2))
    table = plan.format_table(["NVIDIA A100", "Tesla V100"])
    assert "rank" in table and "samples/step" in table and "NVIDIA A100" in table and "62.5%" in table
    assert "predicted step time 15" in table
    with pytest.raises(ValueError, match="unknown keys \\['speed'\\]"):
        Plan.from_dict({**plan.to_dict(), "speed": 1})
    with pytest.raises(ValueError, match="differs from train_batch_size 17"):
        Plan((5, 3), (2, 2), 17, "manual", (1.0, 1.0))


# Prior-score helpers (behind the engine's scheduling API)


def _description(name, score, source="spec"):
    return DeviceDescription(rank=0, local_rank=0, host="h", name=name, memory_bytes=1, bf16=True, fp16=True,
                             accelerator="cuda", spec_score=score, score_source=source)


def test_device_score_accepts_descriptions_dicts_and_names():
    assert device_score(_description("NVIDIA A100-SXM4-80GB", 312.0)) == 312.0
    assert device_score(_description("cpu", 0.7, "measured").to_dict()) == 0.7
    assert device_score({"score": 2.5}) == 2.5
    assert device_score("Tesla V100-SXM2-32GB") == 125.0
    assert device_score({"name": "NVIDIA A100-SXM4-80GB", "dtype": "fp32"}) == 19.5
    with pytest.raises(ValueError, match="not in the accelerator table"):
        device_score("Mystery Accelerator 9000")


def test_distribute_workload_is_the_compute_aware_split_of_the_scores():
    assert distribute_workload([0.5, 0.3, 0.2], 100) == [50, 30, 20]
    assert distribute_workload([1, 1, 1], 20) == [7, 7, 6]  # ties go to the lower ranks
    # 32 per micro-step at times per sample 1/2 and 1: [22, 10] and [21, 11] both take 11; the
    # lower rank gets the tie.
    assert distribute_workload([2.0, 1.0], 64, 2) == [22, 10]
    # At least one sample per rank, however slow.
    assert distribute_workload([0.97, 0.01, 0.01, 0.01], 6) == [3, 1, 1, 1]
    rng = random.Random(3)
    for _ in range(200):
        shares = [rng.uniform(0.001, 1) for _ in range(rng.randint(1, 9))]
        units = rng.randint(len(shares), 200)
        sizes = distribute_workload(shares, units)
        assert sum(sizes) == units and min(sizes) >= 1
    with pytest.raises(ValueError, match="at least one per rank"):
        distribute_workload([0.5, 0.5], 1)


def test_schedule_heterogeneous_tasks():
    plan = schedule_heterogeneous_tasks(["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"], 256, 2)
    assert sum(plan.micro_batch_sizes) == 128 and plan.micro_batch_sizes[0] > plan.micro_batch_sizes[1]
    unknown = schedule_heterogeneous_tasks([_description("a", 312.0), _description("b", 0.0, "unknown")], 16)
    assert unknown.micro_batch_sizes == (8, 8) and "ranks [1] have no known speed" in unknown.notes[0]
