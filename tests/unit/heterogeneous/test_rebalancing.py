# SPDX-License-Identifier: Apache-2.0
"""Dynamic rebalancing: the hysteresis policy, and two ranks whose speeds change mid-run."""

import os
from types import SimpleNamespace

import pytest
import torch

from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
from deepspeed.runtime.heterogeneous.planning.probe_sizes import spread_profiling_sizes, wanted_spread
from deepspeed.runtime.heterogeneous.planning.profiling import measured_time_models
from deepspeed.runtime.heterogeneous.planning.rebalance import Rebalancer, RebalancePolicy
from deepspeed.runtime.heterogeneous.planning.statistics import interval_noise, interval_statistics
from harness import run_ranks, run_subcases
from references import adam_mse_reference

# -- the policy -----------------------------------------------------------------------------------


def test_one_noisy_check_never_rebalances():
    policy = RebalancePolicy(0.1)
    assert not policy.check(1.0, 0.5).rebalance  # a single interval, however bad
    assert not policy.check(1.0, 0.97).rebalance  # back to noise: the streak is reset
    assert not policy.check(1.0, 0.5).rebalance
    decision = policy.check(1.0, 0.6)
    assert decision.rebalance and decision.predicted_gain == pytest.approx(0.4)


def test_cooldown_after_a_rebalance():
    policy = RebalancePolicy(0.1, cooldown_checks=1)
    policy.check(2.0, 1.0)
    assert policy.check(2.0, 1.0).rebalance
    assert "cool-down" in policy.check(2.0, 1.0).reason  # the new plan is measured first
    assert not policy.check(2.0, 1.0).rebalance  # the streak starts again after the cool-down
    assert policy.check(2.0, 1.0).rebalance


def test_noise_below_the_threshold_never_rebalances():
    generator = torch.Generator().manual_seed(0)
    policy = RebalancePolicy(0.1)
    # +-5% timing noise on both plans' predictions, 1000 checks.
    for _ in range(1000):
        current, best = (1.0 + 0.05 * (2 * torch.rand(2, generator=generator) - 1)).tolist()
        assert not policy.check(current, min(best, current)).rebalance


def test_profiled_models_replace_a_flat_fit():
    """The fit of the profiling steps: rank 0 timed at 9 and 7 samples ~0.1 s either way on a
    loaded machine (flat: noise, not a fixed cost), rank 1 proportional. The flat fit becomes
    proportional time through its mean point, and the optimizer step stays a fixed cost."""

    def step(rank0, rank1):
        return [{"samples": rank0, "step_overhead": 0.02}, {"samples": rank1, "step_overhead": 0.04}]

    history = [step([(8, 0.5)], [(8, 0.5)]),  # warm-up: left out
               step([(9, 0.100)], [(7, 0.140)]), step([(7, 0.099)], [(9, 0.180)]),
               step([(9, 0.1005)], [(7, 0.140)]), step([(7, 0.0985)], [(9, 0.180)])]
    models, fits = measured_time_models(history, gradient_accumulation_steps=1)
    assert fits[0].a == 0.0 and fits[0].b == pytest.approx(0.0995 / 8, rel=1e-3)
    assert fits[1].a == pytest.approx(0.0, abs=1e-9) and fits[1].b == pytest.approx(0.02)
    assert [m.a for m in models] == pytest.approx([0.02, 0.04])  # the optimizer step, per micro-step
    with pytest.raises(ValueError, match="no samples"):
        measured_time_models([step([], [(8, 0.5)])], gradient_accumulation_steps=1)


def _plan(sizes, batch=16):
    return plan_micro_batches([TimeModel(0.0, 1.0)] * len(sizes), train_batch_size=batch,
                              gradient_accumulation_steps=1, strategy="manual", manual=list(sizes))


def _best_plan_for(models):
    return plan_micro_batches(models, train_batch_size=16, gradient_accumulation_steps=1, strategy="compute_aware")


def test_rebalancer_follows_a_real_slow_down_and_keeps_the_plan_when_nothing_changed():
    rebalancer = Rebalancer(RebalancePolicy(0.1))
    rebalancer.plan_chosen([TimeModel(0.0, 0.01), TimeModel(0.0, 0.02)])
    plan = _plan([11, 5])
    steady = [[0.11] * 4, [0.10] * 4]
    assert not rebalancer.check(plan, steady, _best_plan_for).rebalance  # the baseline interval
    assert not rebalancer.check(plan, steady, _best_plan_for).rebalance
    assert rebalancer.check(plan, steady, _best_plan_for).predicted_gain == 0.0
    slowed = [[0.11] * 4, [0.30] * 4]  # rank 1 three times slower
    assert not rebalancer.check(plan, slowed, _best_plan_for).rebalance  # one check is not enough
    decision = rebalancer.check(plan, slowed, _best_plan_for)
    assert decision.rebalance and decision.plan.micro_batch_sizes[0] > 11, decision


def test_a_start_up_plan_kept_for_noise_is_corrected_by_the_checks():
    """Profiling kept [8, 8] within its noise, so no models chose the plan (``plan_chosen(None)``).
    The first check fits per-sample models from its own interval: rank 0 0.08 s per micro-step of 8
    samples (0.01 s per sample), rank 1 0.16 s (0.02 s per sample). Under those models the best
    split of 16 is [11, 5] (0.11 s vs 0.10 s against 0.16 s now: a 31% predicted gain), adopted on
    the second check after the baseline (two in a row). Equal ranks with the same per-step scatter
    never move a sample."""
    plan = _plan([8, 8])
    slower = [[0.08, 0.081, 0.079, 0.08], [0.16, 0.161, 0.159, 0.16]]
    rebalancer = Rebalancer(RebalancePolicy(0.1))
    rebalancer.plan_chosen(None)
    decisions = [rebalancer.check(plan, slower, _best_plan_for) for _ in range(3)]
    assert [d.rebalance for d in decisions] == [False, False, True], decisions
    assert list(decisions[-1].plan.micro_batch_sizes) == [11, 5], decisions[-1]

    equal = [[0.08, 0.084, 0.076, 0.08], [0.08, 0.076, 0.084, 0.081]]
    rebalancer = Rebalancer(RebalancePolicy(0.1))
    rebalancer.plan_chosen(None)
    assert not any(rebalancer.check(plan, equal, _best_plan_for).rebalance for _ in range(6))


def test_a_predicted_gain_within_the_measured_noise_moves_nothing():
    """A steady run must not move a sample on noise. Here the interval means say rank 1
    got 50% slower, so a one-sample move [11, 5] -> [12, 4] predicts a 20% gain (above the 10%
    threshold) on every check; but rank 1's per-step times scatter by +-35%, so the gain is within
    the noise. Measured without scatter, the same means do move the sample."""
    plan = _plan([11, 5])
    reference = [TimeModel(0.0, 0.01), TimeModel(0.0, 0.02)]
    baseline = [[0.11, 0.11, 0.11, 0.11], [0.10, 0.10, 0.10, 0.10]]
    noisy = [[0.10, 0.12, 0.10, 0.12], [0.10, 0.20, 0.09, 0.21]]  # means 0.11 and 0.15
    flat = [[sum(times) / 4] * 4 for times in noisy]

    def decisions(interval):
        rebalancer = Rebalancer(RebalancePolicy(0.1))
        rebalancer.plan_chosen(reference)
        rebalancer.check(plan, baseline, _best_plan_for)
        return [rebalancer.check(plan, interval, _best_plan_for) for _ in range(2)]

    without_scatter = decisions(flat)
    assert without_scatter[-1].rebalance and list(without_scatter[-1].plan.micro_batch_sizes) == [12, 4]
    with_scatter = decisions(noisy)
    assert not any(d.rebalance for d in with_scatter), with_scatter
    assert all("within the measured noise" in d.reason for d in with_scatter)


def test_interval_noise_is_the_standard_error_of_both_intervals():
    mean, error = interval_statistics([1.0, 1.0, 1.0, 1.0])
    assert (mean, error) == (1.0, 0.0)
    mean, error = interval_statistics([0.9, 1.1, 0.9, 1.1])
    assert mean == pytest.approx(1.0) and error == pytest.approx(1.4826 * 0.1 / 2, rel=1e-3)
    # One outlier step moves neither the centre nor the error much (the mean would be 1.25).
    centre, outlier_error = interval_statistics([1.0, 1.02, 0.98, 2.0])
    assert centre == pytest.approx(1.01) and outlier_error < 0.02
    assert interval_noise([(1.0, 0.03)], [(1.0, 0.04)]) == pytest.approx(2 * 0.05)


def test_the_profiling_spread_reaches_the_last_rank_of_an_odd_world():
    """Profiling spreads every rank's sizes, the last rank of an odd world included (pairing ranks
    as (0, 1), (2, 3), ... would leave it at one size)."""
    for sizes in ([8, 8, 8], [6, 6, 6, 6, 8], [12, 3, 9]):
        seen = [{s} for s in sizes]
        spread = spread_profiling_sizes(sizes, seen)
        assert sum(spread) == sum(sizes) and min(spread) >= 1
        for rank, size in enumerate(spread):
            assert abs(size - sizes[rank]) >= wanted_spread(size), (sizes, spread, rank)
    # A rank already timed far enough apart is left alone; memory caps bound what a rank takes.
    assert spread_profiling_sizes([8, 8, 8], [{6, 8}, {6, 8}, {6, 8}]) == [8, 8, 8]
    capped = spread_profiling_sizes([8, 8, 8], [{8}, {8}, {8}], caps=[8, 9, 8])
    assert sum(capped) == 24 and all(size <= cap for size, cap in zip(capped, [8, 9, 8]))


def test_monitoring_synchronises_the_device_once_per_step(monkeypatch):
    """Dynamic rebalancing's monitoring times whole steps: one device synchronisation at the step's
    end, not 2-3 per micro-step; profiling keeps the per-micro-step path. Every micro-step gets its
    share of the step, optimizer included."""
    from deepspeed.runtime.heterogeneous.measure import timing

    synchronisations = []
    accelerator = SimpleNamespace(synchronize=lambda: synchronisations.append(1))
    monkeypatch.setattr(timing, "get_accelerator", lambda: accelerator)

    def one_step(timer, per_micro_step, micro_steps=4):
        synchronisations.clear()
        for _ in range(micro_steps):
            timer.begin_micro_step(per_micro_step)
            timer.end_micro_step(8, None)
        return timer.end_step(), len(synchronisations)

    timer = timing.StepTimer()
    monitored, count = one_step(timer, per_micro_step=False)
    assert count == 1
    assert [size for size, _, _ in monitored.samples] == [8] * 4 and monitored.step_overhead == 0.0
    assert len({t for _, t, _ in monitored.samples}) == 1 and monitored.time_per_micro_step > 0
    profiled, count = one_step(timer, per_micro_step=True)
    assert count == 2 * 4 + 1  # both ends of every micro-step, and the optimizer step
    assert profiled.time_per_micro_step == pytest.approx(
        (sum(t for _, t, _ in profiled.samples) + profiled.step_overhead) / 4)


def test_threshold_is_validated():
    with pytest.raises(ValueError, match="imbalance_threshold"):
        RebalancePolicy(1.5)


# -- end to end -----------------------------------------------------------------------------------

# Compute-dominated (tens of ms per step), so that a plan is decided by per-sample cost and not by
# the few milliseconds of per-step overhead and scheduling noise of a 2-core machine.
WIDTH, HIDDEN = 512, 2048
TRAIN_BATCH = 16
LR = 1e-3
CHECK_INTERVAL = 4


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))


def dataset(size):
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.arange(size), torch.randn(size, WIDTH, generator=generator),
                                          torch.randn(size, WIDTH, generator=generator))


def config(speeds, schedule=None, stage=1):
    emulation = {"speeds": list(speeds), "mode": "dilation"}
    if schedule:
        emulation["speed_schedule"] = schedule
    return {"train_batch_size": TRAIN_BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware", "profile_steps": 3,
                                     "scheduler": {"dynamic_rebalancing": True, "imbalance_threshold": 0.1,
                                                   "check_interval": CHECK_INTERVAL},
                                     "emulation": emulation}}


def train(rank, world_size, speeds, schedule, steps, die_at=None, stage=1, dying_rank=1):
    import deepspeed

    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config(speeds, schedule, stage),
                                                training_data=dataset(steps * TRAIN_BATCH))
    runtime = engine._heterogeneous_runtime()
    seen, plans = [], []
    batches = iter(loader)
    for step in range(1, steps + 1):
        index, inputs, targets = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        if step == die_at and rank == dying_rank == 1:
            os._exit(23)  # killed at a check: the other rank is left in the gather
        if step == die_at and rank == dying_rank == 0:
            # Killed while deciding, after the gather: rank 1 is left waiting for the broadcast. (The
            # whole decision, not only the rebalancer's check: when profiling switched the plan, the
            # check at step 7 judges that switch and may revert it without asking the rebalancer.)
            runtime.decisions.at_check = lambda *args: os._exit(24)
        engine.step()
        seen.append(index.tolist())
        plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
    events = runtime.decisions.events
    return {"seen": seen, "plans": plans, "events": [(e.step, e.old_sizes, e.new_sizes) for e in events],
            "judged": [(e.step, e.kind, e.observed_gain) for e in events],
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def reference(step_indices, size):
    _, inputs, targets = dataset(size).tensors
    return adam_mse_reference(make_model(), inputs, targets, step_indices, LR)


@pytest.mark.multiprocess
def test_a_speed_change_under_dynamic_rebalancing_keeps_the_ranks_agreed_and_training_exact():
    change, steps = 29, 44
    cases = [
        # Rank 0 runs at 0.4 of rank 1's speed; at step 29 it is the fast one and rank 1 drops to 0.3.
        # Whatever profiling chose (work moved to rank 1, or [8, 8] kept), following the change
        # moves work to rank 0. Unequal ranks at start-up keep the test independent of profiling:
        # with equal ranks, a noise-driven plan close to the one the change calls for would leave
        # nothing to follow (test_plan_trust covers the gate on equal ranks).
        # Drift is measured against the first whole interval of the plan in force, so that interval
        # must not contain the change. The plan settles by step 27 on every path before it: profiling
        # keeps [8, 8] (noise on a loaded machine), the checks at 7, 11 and 15 move work to rank 1 at
        # 15, its check at 19 finds it slower within the noise and runs [8, 8] again, and the
        # comparison at 23 leaves one of the two whose first whole interval ends at 27. (A fresh-clone
        # CI run once took the first half of that path with the change at 17: the plan adopted at 15
        # had its baseline at 16-19, across the change, and the later checks saw only part of it.)
        dict(speeds=[0.4, 1.0], schedule=[{"step": change, "speeds": [1.0, 0.3]}], steps=steps),
        # Constant speeds over a longer run (11 checks): no move on noise (see the assertion).
        dict(speeds=[1.0, 0.5], schedule=None, steps=56),
    ]
    changed, steady = run_subcases(train, cases, world_size=2, timeout=600)
    fast, slow = changed
    # Every rank took the same decisions at the same steps. Which moves the checks make, and when,
    # follows measured step times: how soon a change is followed is tests/perf/bench_rebalancing.py's
    # (target: back to 90% of the new ideal within two check intervals), not a unit test's.
    assert fast["events"] == slow["events"] and fast["plans"] == slow["plans"]
    step_indices = [a + b for a, b in zip(fast["seen"], slow["seen"])]
    assert sorted(i for s in step_indices for i in s) == list(range(steps * TRAIN_BATCH))
    for got, want in zip(fast["params"], reference(step_indices, steps * TRAIN_BATCH)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # A move whose predicted gain is within the measured noise is refused (the policy's gate,
    # test_a_predicted_gain_within_the_measured_noise_moves_nothing). One move can still come when
    # the plan's first interval paid one-off costs at its new sizes, which later intervals read as
    # a speed-up (e.g. [12, 4] -> [13, 3] at step 15, then 14.6% faster). It must not stay if it
    # made the step slower: kept only within the step-time noise of a loaded 2-core machine (a
    # fresh-clone CI run once observed -8.7% for a kept move), else sent back to the plan before
    # (a revert, or the first half of a comparison, which may return to the move once).
    # (The check of the switch after profiling, at step 7, may revert it: that is its job.)
    judged = [event for event in steady[0]["judged"] if event[0] > 3 + CHECK_INTERVAL]
    moves = [event for event in judged if event[1] == "rebalance"]
    # What must not happen, whatever the machine's load made the checks measure: a move that the
    # runtime itself measured as making the step slower, and that stayed. (How few moves a steady
    # run makes is a timing question: bench_rebalancing.py.)
    for step, kind, gain in moves:
        slower = gain is not None and gain <= -0.10
        assert not slower or any(later[1] == "revert" and later[0] > step for later in judged), judged


@pytest.mark.multiprocess
@pytest.mark.parametrize("dying_rank", [1, 0])
def test_a_rank_dying_at_a_rebalancing_check_stops_the_other_with_its_name(dying_rank):
    """The survivor's PlanAgreementError names the rank that failed, not only itself."""
    with pytest.raises(AssertionError) as info:
        # ZeRO-0 without clipping: after backward's all-reduce, the next collective is the gather of
        # the interval's measurements at the check; the first check is after the 3 profiling steps
        # and one whole interval: step 7. Rank 1 dies before the gather; rank 0 after it, before
        # the broadcast of its decision.
        run_ranks(train, world_size=2, timeout=300, args=([1.0, 0.5], None, 12, 3 + CHECK_INTERVAL, 0, dying_rank))
    report = str(info.value)
    if dying_rank == 1:
        assert "rank 1 exited with code 23" in report
        assert ("PlanAgreementError: deepspeed-hetero: data-parallel rank 0 could not gather the measurements of "
                "step 7 to agree on a plan; a peer rank failed or timed out: global rank(s) [1] never reached this "
                "agreement"
                in report), report
    else:
        assert "rank 0 exited with code 24" in report
        assert ("PlanAgreementError: deepspeed-hetero: data-parallel rank 1 did not receive the rebalancing "
                "decision from global rank 0; global rank 0" in report), report


def test_a_new_agreement_instance_names_the_rank_that_did_not_arrive(monkeypatch):
    """Check-ins are counted per process, not per ``Agreement``: the start-up code makes a new
    instance for each agreement, and a rank has one check-in key for all of them. Here global rank 0
    (this process) and rank 1 pass three agreements, then rank 0 alone enters one more, through a
    new instance, whose collective fails."""
    from torch.distributed import HashStore
    from deepspeed.runtime.heterogeneous.cluster import agreement
    from deepspeed.runtime.heterogeneous.cluster.agreement import Agreement, PlanAgreementError

    store = HashStore()
    monkeypatch.setattr(agreement, "_store", lambda: store)
    monkeypatch.setattr(agreement.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(agreement.dist, "barrier", lambda *args, **kwargs: None)
    controller = Agreement("data-parallel rank 0")
    for step in range(3):
        controller.barrier(f"step {step}")
        store.set("deepspeed-hetero/agreement/1", store.get("deepspeed-hetero/agreement/0"))  # rank 1 there too

    def peer_gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(agreement.dist, "barrier", peer_gone)
    with pytest.raises(PlanAgreementError) as info:
        Agreement("data-parallel rank 0").barrier("the start-up plan")
    assert "global rank(s) [1] never reached this agreement" in str(info.value), str(info.value)


def _reschedule(rank, world_size):
    import deepspeed

    model = make_model()
    cfg = config([1.0, 1.0])
    cfg["heterogeneous_config"]["scheduler"]["dynamic_rebalancing"] = False
    cfg["heterogeneous_config"]["profile_steps"] = 0
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                                training_data=dataset(8 * TRAIN_BATCH))
    batches = iter(loader)
    for _ in range(2):
        _, inputs, targets = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    before = list(engine.heterogeneous_plan.micro_batch_sizes)
    try:
        engine.reschedule_workload([1.0])
        bad = None
    except ValueError as exc:
        bad = str(exc)
    # Without metrics in the static phase (no profiling, no dynamic rebalancing) nothing was
    # measured: every rank says why, together, and the run can go on.
    from deepspeed.runtime.heterogeneous.runtime import RescheduleError
    try:
        engine.reschedule_workload()
        static = None
    except RescheduleError as exc:
        static = str(exc)
    # A predicted gain of 6% ([9, 7] for busy times 1.0 and 1.2) is below the 10% threshold:
    # a rebalance on demand keeps the plan, as automatic rebalancing does.
    below = list(engine.reschedule_workload({"busy_seconds": [1.0, 1.2]}).micro_batch_sizes)
    # Rank 1 reports three times rank 0's busy time for the same share: it gets about a quarter.
    after = list(engine.reschedule_workload({"busy_seconds": [1.0, 3.0]}).micro_batch_sizes)
    _, inputs, targets = next(batches)  # the loader follows the new plan at the next step
    return {"before": before, "below": below, "after": after, "bad": bad, "next_batch": len(inputs), "static": static}


@pytest.mark.multiprocess
def test_reschedule_workload_on_demand():
    results = run_ranks(_reschedule, world_size=2, timeout=300)
    assert results[0]["after"] == results[1]["after"]
    assert results[0]["before"] == [8, 8] and results[0]["after"] == [12, 4], results
    assert results[0]["below"] == results[1]["below"] == [8, 8], results
    assert [r["next_batch"] for r in results] == [12, 4]
    assert all("one positive busy time per data-parallel rank (2)" in r["bad"] for r in results), results
    assert all(r["static"] and "nothing is measured once the plan has settled" in r["static"]
               and "\n" not in r["static"] for r in results), results
