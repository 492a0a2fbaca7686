# SPDX-License-Identifier: Apache-2.0
"""Plans a user can trust: profiling keeps the start-up plan when the ranks' measured
speeds differ only by noise and never takes an absurd split; a switch that made the step slower
is reverted and not retried soon; reschedule_workload applies the threshold; a failure of rank
0's decision reaches every rank at once."""

import math
import time

import pytest
import torch

from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
from deepspeed.runtime.heterogeneous.planning.profiling import (beyond_measured_ratio, plan_after_profiling_step,
                                                                rank_errors, measured_time_models, reference_walls,
                                                                significant_difference, trusted_plan)
from deepspeed.runtime.heterogeneous.cluster.agreement import (PlanDecisionError, decision_failure,
                                                               raise_decision_failure)
from deepspeed.runtime.heterogeneous.planning.rebalance import Rebalancer, RebalancePolicy
from deepspeed.runtime.heterogeneous.planning.statistics import MIN_SLOWDOWN, slowdown_beyond_noise
from deepspeed.runtime.heterogeneous.planning.time_model import relative_standard_error
from harness import VirtualDevice, run_subcases

BATCH = 32


def _plan(sizes, batch=BATCH, strategy="manual"):
    return plan_micro_batches([TimeModel(0.0, 1.0)] * len(sizes), train_batch_size=batch,
                              gradient_accumulation_steps=1, strategy=strategy, manual=list(sizes))


UNIFORM = _plan([16, 16])


def _history(per_sample, sizes, noise, overheads=(0.0, 0.0), wall=None):
    """Profiling steps of 2 ranks, gas 1: step k runs ``sizes[k]`` (per rank), rank r takes
    ``per_sample[r] * mbs * (1 + noise[r][k])`` seconds; the first step is the warm-up."""
    history = []
    for k, step_sizes in enumerate(sizes):
        step = []
        for rank, size in enumerate(step_sizes):
            seconds = per_sample[rank] * size * (1 + noise[rank][k])
            step.append({"samples": [(size, seconds, None)], "step_overhead": overheads[rank], "state_bytes": 0,
                         "wall": wall[k] if wall else None})
        history.append(step)
    return history


# The sizes profiling runs: warm-up at the start-up plan, spread steps, the start-up plan again.
SIZES = [(16, 16), (12, 20), (16, 16), (12, 20), (16, 16)]


# -- the noise gate -------------------------------------------------------------------------------


def test_relative_standard_error_is_unknown_without_a_degree_of_freedom():
    model = TimeModel(0.0, 1.0)
    assert relative_standard_error(model, [(4, 4.0)], 1) == math.inf
    assert relative_standard_error(model, [(4, 4.0), (8, 8.0)], 2) == math.inf
    assert relative_standard_error(model, [(4, 4.0), (8, 8.0)], 1) == 0.0
    # +-10% around the model, 4 points, 1 parameter: rms 0.1 * sqrt(4/3), over sqrt(4).
    error = relative_standard_error(model, [(4, 4.4), (4, 3.6), (8, 8.8), (8, 7.2)], 1)
    assert error == pytest.approx(0.1 * math.sqrt(4 / 3) / 2)


def test_equal_ranks_measured_apart_by_noise_keep_the_uniform_split():
    """Identical ranks whose noisy micro-steps (+-35%) make rank 1 look 30% slower. The
    measured best plan moves work; the gate keeps [16, 16] and says why. Without the scatter the
    same means are a real difference, and the plan follows them."""
    noise = [[0.0, 0.35, -0.35, -0.35, 0.35], [0.0, -0.35, 0.35, 0.35, -0.35]]
    noisy = _history([1.0, 1.3], SIZES, noise)
    decision = trusted_plan(noisy, UNIFORM, 1, None, False)
    assert decision.plan is UNIFORM and decision.models is None
    assert list(decision.best.micro_batch_sizes) != [16, 16]  # what the fit alone would have done
    assert "kept the start-up plan" in decision.note and "within the measured noise" in decision.note
    # The verdict says what to change: the setting, its value now, and a value to try.
    assert "raise heterogeneous_config.profile_steps (now" in decision.note, decision.note
    assert "scheduler.dynamic_rebalancing" in decision.note, decision.note
    steady = _history([1.0, 1.3], SIZES, [[0.0] * 5, [0.0] * 5])
    decision = trusted_plan(steady, UNIFORM, 1, None, False)
    assert list(decision.plan.micro_batch_sizes) == [18, 14], decision
    assert "beyond the noise" in decision.note


def test_a_real_difference_passes_the_gate_despite_noise():
    """Rank 1 at 0.4 of rank 0's speed, with +-15% scatter: the difference is far beyond the noise."""
    noise = [[0.0, 0.15, -0.15, -0.15, 0.15], [0.0, -0.15, 0.15, 0.15, -0.15]]
    decision = trusted_plan(_history([1.0, 2.5], SIZES, noise), UNIFORM, 1, None, False)
    assert decision.plan.micro_batch_sizes[0] >= 21, decision


def test_the_gate_reads_the_start_up_plan_steps_where_a_new_size_paid_one_off_costs():
    """Rank 1 takes 1.6x rank 0's time per sample. Rank 0's first step at 20 samples paid one-off
    allocations (+60%), which makes its fit look nearly as slow as rank 1 (1.17x under the
    start-up plan: within the noise) and its noise large; the step at the start-up plan, timed
    after the warm-up, still shows the difference beyond that noise."""
    noise = [[0.0, 0.6, 0.0], [0.0, 0.0, 0.0]]
    sizes = [(16, 16), (20, 12), (16, 16)]
    history = _history([1.0, 1.6], sizes, noise)
    models, fits = measured_time_models(history, 1)
    errors = rank_errors(history, models, fits)
    assert significant_difference(models, errors, UNIFORM) is None
    decision = trusted_plan(history, UNIFORM, 1, None, False)
    assert decision.plan.micro_batch_sizes[0] > 16 and "rank 1 measured 1.60x rank 0's time" in decision.note


# Measured (ms) in bench_profiling_gate.py, 5 profiling steps, rank 1 at 0.25 by time dilation:
# per step and rank (micro-batch size, forward+backward, optimizer step). Rank 1's time hardly
# grows with its samples (2 take as long as 8): its fixed cost, slowed 4x, dominates.
FIXED_COST_DOMINATED = [[(8, 27.3, 18.6), (8, 105.7, 24.5)], [(10, 14.5, 14.8), (6, 67.5, 7.9)],
                        [(8, 17.2, 9.8), (8, 90.7, 6.2)], [(14, 18.8, 8.8), (2, 91.1, 10.0)],
                        [(8, 18.5, 10.0), (8, 70.0, 9.0)]]


def test_a_rank_whose_fixed_cost_dominates_is_measured_against_its_own_line():
    """Rank 1 takes 3.2x rank 0's time under [8, 8], mostly fixed cost. Its flat times fall back to
    a proportional model for planning; read against that model its scatter would be 60% noise and
    the gate would keep [8, 8]; about the least-squares line through its micro-steps it is 8%."""
    history = [[{"samples": [(size, forward / 1e3, None)], "step_overhead": step / 1e3, "state_bytes": 0,
                 "wall": None} for size, forward, step in ranks] for ranks in FIXED_COST_DOMINATED]
    models, fits = measured_time_models(history, 1)
    errors = rank_errors(history, models, fits)
    assert errors[1] < 0.1, errors
    rank1 = [(m, (t + o) / 1e3) for _, (m, t, o) in FIXED_COST_DOMINATED[1:]]
    assert relative_standard_error(models[1], rank1, 1) > 0.4  # what the gate read before
    decision = trusted_plan(history, _plan([8, 8], batch=16), 1, None, False)
    assert decision.plan.micro_batch_sizes[0] > 8 and "rank 1 measured 3.17x" in decision.note, decision.note


def test_one_micro_step_per_rank_cannot_tell_the_ranks_apart():
    history = _history([1.0, 3.0], SIZES[:2], [[0.0, 0.0], [0.0, 0.0]])
    models, fits = measured_time_models(history, 1)
    assert rank_errors(history, models, fits) == [math.inf, math.inf]
    decision = trusted_plan(history, UNIFORM, 1, None, False)
    assert decision.plan is UNIFORM and "too few micro-steps" in decision.note


def test_the_kept_plan_names_its_figures_and_calls_noise_measured_only_when_it_is():
    """3 profiling steps, gas 1: after the warm-up each rank has 2 micro-steps, too few for a line
    of their own, so a rank's error counts its fixed cost as noise. Rank 1 takes 1.6x rank 0's
    time under [16, 16], within that bound: the plan is kept, the note gives the spread and the
    bound and says the steps were too few, not that the timing is that noisy. With 5 steps the
    scatter is measured, and only then is it "the measured noise"."""
    sizes, seconds = [(16, 16), (20, 12), (16, 16)], [(1.0, 1.0), (1.0, 2.0), (1.0, 1.6)]
    flat = [[{"samples": [(size, t, None)], "step_overhead": 0.0, "state_bytes": 0, "wall": None}
             for size, t in zip(step, times)] for step, times in zip(sizes, seconds)]
    decision = trusted_plan(flat, UNIFORM, 1, None, False)
    assert decision.plan is UNIFORM, decision
    assert "differ by up to 60.0%" in decision.note and "bound 83.1% for rank 1 against rank 0" in decision.note
    assert "measured noise" not in decision.note and "3 profiling steps were" in decision.note, decision.note
    noise = [[0.0, 0.35, -0.35, -0.35, 0.35], [0.0, -0.35, 0.35, 0.35, -0.35]]
    decision = trusted_plan(_history([1.0, 1.3], SIZES, noise), UNIFORM, 1, None, False)
    assert "differ by up to 30.0%, within the measured noise (bound 101.4%" in decision.note, decision.note


def test_one_rank_keeps_its_plan_without_advice():
    """One data-parallel rank has no speeds to compare: no spread line ("differ by up to 0.0%") and
    no advice to raise profile_steps."""
    history = _history([1.0], [(32,)] * 3, [[0.0, 0.1, -0.1]], overheads=(0.0,))
    decision = plan_after_profiling_step(history, _plan([32]), 1, None, False, steps_left=0)
    assert list(decision.plan.micro_batch_sizes) == [32] and decision.note == "", decision


def test_a_datasheet_start_up_plan_is_the_reference_of_the_gate():
    """Start-up plan [24, 8] from datasheet scores 3:1; the ranks measure 3:1 (+-noise): kept."""
    startup = _plan([24, 8])
    sizes = [(24, 8), (20, 12), (24, 8), (20, 12), (24, 8)]
    noise = [[0.0, 0.05, -0.05, -0.05, 0.05], [0.0, -0.05, 0.05, 0.05, -0.05]]
    history = _history([1.0, 3.0], sizes, noise)
    models, fits = measured_time_models(history, 1)
    assert significant_difference(models, rank_errors(history, models, fits), startup) is None
    assert trusted_plan(history, startup, 1, None, False).plan is startup


def test_an_absurd_split_never_comes_out_of_a_waiting_rank():
    """With rank 1 throttled, rank 0's optimizer step measured the wait for rank 1 (time
    that is not its compute): 5 ms of fixed cost against 1 ms of compute for 16 samples. The fitted
    models then give rank 1, no faster per sample, 31 of 32 samples; the guard caps a rank at
    1.5x what the measured per-sample speeds give it and falls back to that split."""
    history = _history([1e-3 / 16, 1e-3 / 16], SIZES, [[0.0] * 5, [0.0] * 5], overheads=(5e-3, 0.5e-3))
    models, _ = measured_time_models(history, 1)
    fitted = plan_micro_batches(models, BATCH, 1, "compute_aware")
    assert list(fitted.micro_batch_sizes) == [1, 31]
    decision = trusted_plan(history, UNIFORM, 1, None, False)
    assert list(decision.plan.micro_batch_sizes) == [16, 16], decision
    assert "more than 1.5x the samples of the measured speed ratio" in decision.note
    # Rank 1 takes 31 > 1.5 * 16 + 1, rank 0 takes 1 < 16 / 1.5 - 1: both beyond the measured ratio.
    assert beyond_measured_ratio(fitted, UNIFORM) == [0, 1]
    assert beyond_measured_ratio(_plan([20, 12]), UNIFORM) == []


def test_a_fit_that_starves_the_rank_measured_faster_is_capped_too():
    """A busy neighbour made rank 0 measure 3.74x rank 1's time per sample: the measured ratio gives
    [27, 101] of 128; a fit that gives [1, 127] keeps rank 1 within 1.5x of its 101 (127 <= 152.5)
    but starves rank 0 far below 27 / 1.5 - 1 = 17: capped, not adopted."""
    ratio = _plan([27, 101], batch=128)
    assert beyond_measured_ratio(_plan([1, 127], batch=128), ratio) == [0]
    assert beyond_measured_ratio(_plan([20, 108], batch=128), ratio) == []


def test_profiling_schedule_spreads_toward_the_best_and_ends_at_the_start_up_plan():
    noise = [[0.0] * 5, [0.0] * 5]
    history = _history([1.0, 2.5], SIZES, noise)
    # After the warm-up alone (one micro-step per rank: noise unknown) the start-up plan is kept,
    # spread so that the rank the measurements favour takes the samples.
    first = plan_after_profiling_step(history[:1], UNIFORM, 1, None, False, steps_left=4)
    assert list(first.plan.micro_batch_sizes) == [20, 12], first
    # The step before the last runs the start-up plan: the reference the final switch is judged by.
    reference = plan_after_profiling_step(history[:4], _plan([20, 12]), 1, None, False, steps_left=1,
                                          startup_plan=UNIFORM)
    assert reference.plan is UNIFORM
    final = plan_after_profiling_step(history, UNIFORM, 1, None, False, steps_left=0)
    assert final.plan.micro_batch_sizes[0] > 20 and final.models is not None


def test_reference_walls_are_the_start_up_plan_steps_after_the_warm_up():
    history = _history([1.0, 1.0], SIZES, [[0.0] * 5, [0.0] * 5], wall=[9.0, 2.0, 1.0, 2.0, 1.1])
    assert reference_walls(history, UNIFORM) == [1.0, 1.1]
    assert reference_walls(history, _plan([20, 12])) == []


# -- reverting a switch that made the step slower --------------------------------------------------


def test_slowdown_beyond_noise():
    slowdown, bound = slowdown_beyond_noise([1.0, 1.0, 1.0], [1.3, 1.3, 1.3])
    assert slowdown == pytest.approx(0.3) and bound == MIN_SLOWDOWN
    # Scattered steps: a 10% slower median is within the noise.
    slowdown, bound = slowdown_beyond_noise([1.0, 0.8, 1.2, 1.0], [1.1, 0.85, 1.35, 1.1])
    assert slowdown == pytest.approx(0.1) and bound > slowdown
    # A single reference step borrows the other group's spread instead of claiming no noise.
    _, single = slowdown_beyond_noise([1.0], [1.1, 0.9, 1.2, 0.8])
    _, many = slowdown_beyond_noise([1.0, 0.9, 1.1, 1.0], [1.1, 0.9, 1.2, 0.8])
    assert single > many > MIN_SLOWDOWN
    with pytest.raises(ValueError, match="at least one step"):
        slowdown_beyond_noise([], [1.0])


def _best_plan_for(models):
    return plan_micro_batches(models, train_batch_size=BATCH, gradient_accumulation_steps=1, strategy="compute_aware")


def test_a_switch_that_made_the_step_slower_is_reverted_and_not_retried_soon():
    rebalancer = Rebalancer(RebalancePolicy(0.1), retry_after_checks=3)
    old, new = UNIFORM, _plan([25, 7])
    assert rebalancer.switched(old, new, [1.0, 1.02, 0.98], None, "switch after profiling") is None
    assert rebalancer.judge_switch(new, [1.3, 1.31]) is None  # too few steps yet: they add up
    decision = rebalancer.judge_switch(new, [1.29])
    assert decision.rebalance and decision.revert and decision.plan is old
    assert "slower beyond the noise, reverted" in decision.reason
    assert rebalancer.pending is None and rebalancer.baseline is None
    # Restored on observation: the old plan is the balanced reference, so steady drift moves nothing.
    assert rebalancer.reference_models == [TimeModel(0.0, 1 / 16), TimeModel(0.0, 1 / 16)]
    # The models still favour [25, 7]: on demand (threshold passed) it is refused while it is barred.
    skewed = [TimeModel(0.0, 1.0), TimeModel(0.0, 3.5)]
    for left in (2, 1, 0):
        refused = rebalancer.check_on_demand(old, skewed, _best_plan_for, threshold=0.1)
        assert not refused.rebalance and f"was reverted; not tried again for {left} more check(s)" in refused.reason
    again = rebalancer.check_on_demand(old, skewed, _best_plan_for, threshold=0.1)
    assert again.rebalance and list(again.plan.micro_batch_sizes) == [25, 7]


def test_a_slower_interval_against_two_steps_before_the_switch_is_compared_not_reverted():
    """A real 2.5x difference was undone against a baseline of two (profiling) steps, "+53.0%, noise
    bound 45.0%": so few steps before a switch are compared again on a whole interval instead."""
    rebalancer = Rebalancer(None, retry_after_checks=3)
    old, new = UNIFORM, _plan([26, 6])
    rebalancer.switched(old, new, [0.60, 0.62], None, "switch after profiling")
    first = rebalancer.judge_switch(new, [0.95, 0.92, 0.93, 0.94])
    assert first.rebalance and first.revert and first.plan is old, first
    assert "slower, but against 2 step(s) before the switch, too few to judge by" in first.reason, first.reason
    assert rebalancer.pending is not None and rebalancer.pending.comparing
    # The uniform split, measured on a whole interval, is the slower one: the switch comes back.
    second = rebalancer.judge_switch(old, [1.5, 1.45, 1.55, 1.5])
    assert second.rebalance and second.plan is new and second.reason.endswith("back to [26, 6]"), second.reason


def test_a_faster_switch_is_kept():
    rebalancer = Rebalancer(None)
    old, new = UNIFORM, _plan([18, 14])
    rebalancer.switched(old, new, [1.0, 1.2, 0.8], None, "rebalance")
    decision = rebalancer.judge_switch(new, [0.95, 1.15, 0.8, 0.95])
    assert not decision.rebalance and decision.reason.endswith("kept")
    assert rebalancer.judge_switch(new, [5.0] * 5) is None  # judged once
    # A switch without a measured step before it is not checked, and says so.
    assert "not checked" in rebalancer.switched(old, new, [], None, "reschedule")
    assert rebalancer.judge_switch(new, [5.0] * 5) is None


def test_a_slower_switch_within_the_noise_is_compared_on_more_steps():
    """Two steps before the switch (profiling's at the start-up plan) and a +20% median after it:
    within the noise of so few steps, so the plan before runs again for one interval, and the plan
    whose steps, all counted, are the faster stays."""
    chosen = [TimeModel(0.0, 0.02), TimeModel(0.0, 0.05)]
    for again, stays in (([1.0, 1.02, 0.98, 1.01], UNIFORM), ([1.5, 1.45, 1.55, 1.5], "new")):
        rebalancer = Rebalancer(None, retry_after_checks=3)
        old, new = UNIFORM, _plan([22, 10])
        rebalancer.plan_chosen(chosen)
        rebalancer.switched(old, new, [1.0, 1.3], None, "switch after profiling")
        first = rebalancer.judge_switch(new, [1.2, 1.05, 1.4, 1.2])
        assert first.rebalance and first.revert and first.plan is old, first
        assert "within the noise; back to [16, 16] for one interval" in first.reason
        assert rebalancer.pending is not None and rebalancer.pending.comparing  # judged again later
        assert rebalancer.reference_models == [TimeModel(0.0, 1 / 16), TimeModel(0.0, 1 / 16)]
        second = rebalancer.judge_switch(old, again)
        if stays is UNIFORM:  # 1.005 s over 6 steps at [16, 16] against 1.2 s at [22, 10]
            assert not second.rebalance and "[16, 16] stays; [22, 10] is not tried again for 3 checks" in second.reason
            skewed = [TimeModel(0.0, 1.0), TimeModel(0.0, 2.2)]
            assert not rebalancer.check_on_demand(old, skewed, _best_plan_for, threshold=0.1).rebalance  # barred
        else:  # [16, 16] now 1.5 s: [22, 10] was the faster after all, and its models come back
            assert second.rebalance and second.plan is new and second.reason.endswith("back to [22, 10]")
            assert rebalancer.reference_models == chosen
        assert rebalancer.pending is None


def test_a_rebalance_that_backfires_restores_the_models_of_the_old_plan():
    rebalancer = Rebalancer(RebalancePolicy(0.1, cooldown_checks=0))
    reference = [TimeModel(0.0, 0.01), TimeModel(0.0, 0.01)]
    rebalancer.plan_chosen(reference)
    plan = UNIFORM
    rebalancer.check(plan, [[0.16] * 4, [0.16] * 4], _best_plan_for)  # baseline
    slowed = [[0.16] * 4, [0.48] * 4]
    rebalancer.check(plan, slowed, _best_plan_for)
    decision = rebalancer.check(plan, slowed, _best_plan_for)
    assert decision.rebalance
    rebalancer.switched(plan, decision.plan, [0.5] * 4, rebalancer.previous_models, "rebalance")
    reverted = rebalancer.judge_switch(decision.plan, [0.7] * 4)
    assert reverted.revert and rebalancer.reference_models == reference and rebalancer.baseline is None


# -- reschedule_workload applies the threshold ----------------------------------------------------


def test_reschedule_on_demand_applies_the_threshold():
    """A predicted gain of 5.9% (busy 1.0 vs 1.125 for equal shares) used to move work on demand."""
    rebalancer = Rebalancer(None)
    models = [TimeModel(0.0, 1.0 / 16), TimeModel(0.0, 1.125 / 16)]
    small = rebalancer.check_on_demand(UNIFORM, models, _best_plan_for, threshold=0.1)
    assert not small.rebalance and 0 < small.predicted_gain < 0.1 and "<= threshold 10%" in small.reason
    large = rebalancer.check_on_demand(UNIFORM, [TimeModel(0.0, 1.0 / 16), TimeModel(0.0, 3.0 / 16)],
                                       _best_plan_for, threshold=0.1)
    assert large.rebalance and list(large.plan.micro_batch_sizes) == [24, 8]
    assert Rebalancer(RebalancePolicy(0.5)).check_on_demand(UNIFORM, models, _best_plan_for).reason.endswith(
        "<= threshold 50% (scheduler.imbalance_threshold)")
    with pytest.raises(ValueError, match="imbalance_threshold"):
        Rebalancer(None).check_on_demand(UNIFORM, models, _best_plan_for)


# -- a failed decision reaches every rank ---------------------------------------------------------


def test_decision_failures_keep_their_type_and_message():
    box = decision_failure(ZeroDivisionError("float division by zero"))
    assert box == {"error": "float division by zero", "type": "ZeroDivisionError"}
    with pytest.raises(PlanDecisionError, match="rank 0 raised ZeroDivisionError: float division by zero"):
        raise_decision_failure(box, "rebalancing at step 7 failed")
    with pytest.raises(ValueError, match="no plan fits after profiling step 2: too big"):
        raise_decision_failure(decision_failure(ValueError("too big")), "no plan fits after profiling step 2")


WIDTH = 32
COLLECTIVE_TIMEOUT = 300


def _failing_decision(rank, world_size, failure):
    """Profiling, two steps, then reschedule_workload() on every rank while rank 0's decision fails:
    - ``bypass``: rank 1's micro-steps in those steps are not recorded (as when a rank calls
      ``engine.module(...)`` directly, which now waits in the forward's feeding agreement instead:
      its timer's record is dropped here), so rank 0 has no measurement of rank 1 to plan with;
    - ``crash``: rank 0's planner raises an exception that is not a ValueError (as a bug would)."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))
    config = {"train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 3,
                                       "scheduler": {"dynamic_rebalancing": True, "check_interval": 50}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    runtime = engine._heterogeneous_runtime()
    for step in range(5):
        size = engine.heterogeneous_plan.micro_batch_sizes[rank]
        inputs, targets = torch.randn(size, WIDTH), torch.randn(size, WIDTH)
        if failure == "bypass" and rank == 1 and step == 3:
            runtime.timer.end_micro_step = lambda *args, **kwargs: None
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    if failure == "crash" and rank == 0:

        def crash(*args, **kwargs):
            return 1 / 0

        runtime.decisions.rebalancer.check_on_demand = crash
    started = time.perf_counter()
    try:
        engine.reschedule_workload()
    except Exception as exc:  # noqa: BLE001 -- the test looks at what each rank raised
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - started}
    return {"type": None, "seconds": time.perf_counter() - started}


@pytest.mark.multiprocess
def test_a_failure_of_rank_0s_decision_is_raised_on_every_rank_at_once():
    """Rank 0's decision fails on rank 0 alone (a ZeroDivisionError, or no measurement of a rank):
    the other ranks get the error with it, instead of waiting in the broadcast until the process
    group's time-out."""
    cases = [dict(failure="bypass"), dict(failure="crash")]
    bypass, crash = run_subcases(_failing_decision, cases, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    for result in bypass:
        assert result["type"] == "ValueError", bypass
        assert "data-parallel rank 1 recorded no micro-steps" in result["message"], result
        assert "engine.module(inputs)" in result["message"]
    for result in crash:
        assert result["type"] == "PlanDecisionError", crash
        assert "rank 0 raised ZeroDivisionError: division by zero" in result["message"], result
    # Both errors are the decision's own: a rank left waiting in the broadcast would have raised the
    # process group's time-out error instead.


# -- end to end: a switch after profiling that made the step slower is reverted --------------------

WIDTH, HIDDEN = 64, 128
SECONDS_PER_SAMPLE = 0.01  # virtual, at speed 1.0
PROFILING_SPEEDS, LATER_SPEEDS = (1.0, 0.25), (0.05, 1.0)


def _reverted_after_profiling(rank, world_size, steps):
    """On virtual devices (``harness.VirtualDevice``: the measured times follow from the schedule
    alone), rank 1 runs at a quarter of rank 0's speed during the PROFILE profiling steps (four:
    three fitted steps give the noise gate a line with a degree of freedom), so the plan moves work
    to rank 0; from the first step after profiling rank 0 runs at 0.05 and rank 1 at full speed (a
    neighbour's job moved), so the new plan is much slower than the start-up plan was. Without
    dynamic rebalancing, one check CHECK_INTERVAL steps after profiling goes back to the start-up
    plan: the steps before the switch (profiling's at the start-up plan) are too few to judge by,
    so that plan runs one more interval, and the comparison of the two on all their steps keeps it."""
    import deepspeed

    torch.manual_seed(0)
    device = VirtualDevice(SECONDS_PER_SAMPLE)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH),
                                device.layer())
    config = {"train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": PROFILE, "scheduler": {"check_interval": CHECK_INTERVAL}}}
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16 * steps, WIDTH, generator=generator),
                                          torch.randn(16 * steps, WIDTH, generator=generator))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    runtime = engine._heterogeneous_runtime()
    plans = []
    with device.installed():
        for inputs, targets in loader:
            device.speed = (PROFILING_SPEEDS if len(plans) < PROFILE else LATER_SPEEDS)[rank]
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
            plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
            if len(plans) == steps:
                break
    events = runtime.decisions.events
    return {"plans": plans, "events": [(e.step, list(e.old_sizes), list(e.new_sizes), e.kind) for e in events],
            "verifying": runtime.phase == "verifying", "pending": runtime.decisions.rebalancer.pending is not None}


CHECK_INTERVAL = 4
PROFILE = 4
PROFILED = [13, 3]  # 16 samples in proportion to the profiled speeds 1 : 0.25 (12.8 : 3.2)


@pytest.mark.multiprocess
def test_a_switch_after_profiling_that_made_the_step_slower_is_reverted():
    steps = PROFILE + 2 * CHECK_INTERVAL + 2
    fast, slow = run_subcases(_reverted_after_profiling, [dict(steps=steps)], world_size=2, timeout=600)[0]
    assert fast["plans"] == slow["plans"] and fast["events"] == slow["events"]
    plans = fast["plans"]  # plans[k]: the plan in force after step k + 1
    assert plans[PROFILE - 1:PROFILE - 1 + CHECK_INTERVAL] == [PROFILED] * CHECK_INTERVAL, plans
    # The check at step PROFILE + CHECK_INTERVAL went back to the start-up plan for an interval (the
    # profiling steps before the switch are too few to judge by).
    compared = PROFILE + 2 * CHECK_INTERVAL
    assert plans[PROFILE - 1 + CHECK_INTERVAL:compared - 1] == [[8, 8]] * CHECK_INTERVAL, plans
    revert = (PROFILE + CHECK_INTERVAL, PROFILED, [8, 8], "revert")
    # The comparison at the end of that interval keeps the start-up plan, without another switch:
    # rank 0, now at 0.05, takes 13 x 0.2 s with the profiled plan and 8 x 0.2 s with [8, 8].
    assert plans[compared - 1:] == [[8, 8]] * (steps - compared + 1), plans
    assert fast["events"] == [revert], fast["events"]
    assert not fast["verifying"] and not fast["pending"], fast


def test_every_rebalancing_verdict_names_the_setting_that_would_change_it():
    policy = RebalancePolicy(0.1, cooldown_checks=1, consecutive=1)
    assert "scheduler.check_interval" in policy.check(1.0, 0.97, noise=0.05).reason  # within the noise
    assert "scheduler.imbalance_threshold" in policy.check(1.0, 0.95).reason  # below the threshold
    assert "scheduler.imbalance_threshold" in policy.check(1.0, 0.5).reason  # a move
    assert "scheduler.cooldown_checks" in policy.check(1.0, 0.5).reason  # the cool-down after it
    rebalancer = Rebalancer(None)
    rebalancer.switched(UNIFORM, _plan([18, 14]), [1.0, 1.0, 1.0], None, "rebalance")
    assert "scheduler.check_interval" in rebalancer.judge_switch(_plan([18, 14]), [0.9, 0.9, 0.9]).reason
