# SPDX-License-Identifier: Apache-2.0
"""The runtime controller: explicit phases, all of its state in checkpoints, the comm clock on
only where it is read, the checks gathered to rank 0.

The end-to-end case resumes a run twice: in the middle of the window that judges a switch after
profiling, and after that switch was reverted. The expectation is written out from the schedule
of the run (profiling steps, then a check ``CHECK_INTERVAL`` steps later that reverts to the
start-up plan [8, 8]), not from the code under test: an uninterrupted run of the same schedule is
``test_plan_trust.test_a_switch_after_profiling_that_made_the_step_slower_is_reverted``."""

import pytest
import torch

from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
from deepspeed.runtime.heterogeneous.planning.rebalance import PendingSwitch, Rebalancer, RebalancePolicy
from harness import VirtualDevice, run_subcases

WIDTH, HIDDEN = 64, 128
SECONDS_PER_SAMPLE = 0.01  # virtual, at speed 1.0
PROFILING_SPEEDS, LATER_SPEEDS = (1.0, 0.25), (0.05, 1.0)
PROFILE = 4
CHECK_INTERVAL = 4
STEPS = PROFILE + 2 * CHECK_INTERVAL + 2
FIRST_STOP = PROFILE + 2  # profiling done, the switch is two steps into its check window
SECOND_STOP = PROFILE + CHECK_INTERVAL + 1  # one step after the revert, into the comparison's interval


def _plan(sizes):
    return plan_micro_batches([TimeModel(0.0, 1.0)] * len(sizes), train_batch_size=sum(sizes),
                              gradient_accumulation_steps=1, strategy="manual", manual=list(sizes))


def test_rebalancer_state_round_trip_keeps_pending_reverted_and_startup():
    """Everything a check depends on survives state_dict/load_state_dict as plain values."""
    old, new = _plan([8, 8]), _plan([12, 4])
    saved = Rebalancer(RebalancePolicy(0.1, cooldown_checks=2))
    saved.pending = PendingSwitch(old, new, [TimeModel(0.1, 0.2), TimeModel(0.3, 0.4)], [1.0, 1.1], "switch",
                                  [2.0])
    saved.reverted = {((12, 4), (1, 1)): 7}
    saved.startup_plan = old
    saved.previous_models = [TimeModel(1.0, 2.0), TimeModel(3.0, 4.0)]
    saved.plan_chosen([TimeModel(0.0, 0.5), TimeModel(0.0, 0.25)])
    saved.policy.streak, saved.policy.cooldown = 1, 2
    state = saved.state_dict()
    _assert_plain(state)

    loaded = Rebalancer(RebalancePolicy(0.1, cooldown_checks=2))
    loaded.load_state_dict(state)
    assert list(loaded.pending.old_plan.micro_batch_sizes) == [8, 8]
    assert list(loaded.pending.new_plan.micro_batch_sizes) == [12, 4]
    assert [(m.a, m.b) for m in loaded.pending.old_models] == [(0.1, 0.2), (0.3, 0.4)]
    assert (loaded.pending.before, loaded.pending.after, loaded.pending.label) == ([1.0, 1.1], [2.0], "switch")
    assert loaded.reverted == {((12, 4), (1, 1)): 7}
    assert list(loaded.startup_plan.micro_batch_sizes) == [8, 8]
    assert [(m.a, m.b) for m in loaded.previous_models] == [(1.0, 2.0), (3.0, 4.0)]
    assert [(m.a, m.b) for m in loaded.reference_models] == [(0.0, 0.5), (0.0, 0.25)]
    assert (loaded.policy.streak, loaded.policy.cooldown) == (1, 2)


def test_a_reverted_plan_stays_barred_after_a_resume():
    """Rank 1 became four times slower: the best plan moves work to rank 0, but that plan was
    reverted before the checkpoint, so the resumed rebalancer does not adopt it."""
    plan = _plan([8, 8])
    models = [TimeModel(0.0, 1.0), TimeModel(0.0, 4.0)]
    best = _plan([13, 3])

    saved = Rebalancer(RebalancePolicy(0.1))
    saved.reverted = {((13, 3), (1, 1)): 5}
    loaded = Rebalancer(RebalancePolicy(0.1))
    loaded.load_state_dict(saved.state_dict())
    decision = loaded.check_on_demand(plan, models, lambda _: best)
    assert not decision.rebalance and "reverted" in decision.reason, decision

    fresh = Rebalancer(RebalancePolicy(0.1))  # without the restored state it would be adopted
    assert fresh.check_on_demand(plan, models, lambda _: best).rebalance


def _assert_plain(value):
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), key
            _assert_plain(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _assert_plain(item)
    else:
        assert value is None or isinstance(value, (bool, int, float, str)), type(value)


def _engine(data, device):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH),
                                device.layer())
    config = {"train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": PROFILE, "scheduler": {"check_interval": CHECK_INTERVAL}}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    return engine, loader


def _train(engine, loader, until, plans, device, rank):
    """Steps until global step ``until``, on ``device``'s virtual clock at the schedule's speed. The
    step timer restarts on that clock (a resumed engine's started on the real one as it loaded)."""
    with device.installed():
        engine._heterogeneous_runtime().timer.restart()
        for inputs, targets in loader:
            device.speed = (PROFILING_SPEEDS if engine.global_steps < PROFILE else LATER_SPEEDS)[rank]
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
            plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
            if engine.global_steps == until:
                return


def _controller(runtime):
    rebalancer = runtime.decisions.rebalancer
    return {"phase": runtime.phase.value, "pending": None if rebalancer.pending is None else
            [list(rebalancer.pending.old_plan.micro_batch_sizes), list(rebalancer.pending.new_plan.micro_batch_sizes)],
            "reverted": sorted((list(sizes), count) for (sizes, _), count in rebalancer.reverted.items()),
            "startup": None if rebalancer.startup_plan is None else list(rebalancer.startup_plan.micro_batch_sizes),
            "history": len(runtime.decisions.history), "window": len(runtime._window),
            "events": [(e.step, list(e.old_sizes), list(e.new_sizes), e.kind) for e in runtime.decisions.events]}


def _resumed_twice(rank, world_size, directory):
    """On virtual devices (``harness.VirtualDevice``: the measured times follow from the schedule
    alone), rank 1 runs at a quarter of rank 0's speed while profiling, so the plan moves work to
    rank 0; from step PROFILE + 1 on rank 0 runs at 0.05, so that plan is much slower and its check
    reverts it. Stopped and resumed (a new engine, load_checkpoint) at FIRST_STOP and SECOND_STOP."""
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16 * STEPS, WIDTH, generator=generator),
                                          torch.randn(16 * STEPS, WIDTH, generator=generator))
    device = VirtualDevice(SECONDS_PER_SAMPLE)
    plans, seen = [], {}
    engine, loader = _engine(data, device)
    _train(engine, loader, FIRST_STOP, plans, device, rank)
    seen["saved_first"] = _controller(engine._heterogeneous_runtime())
    engine.save_checkpoint(directory, tag="first")

    engine, loader = _engine(data, device)
    engine.load_checkpoint(directory, tag="first")
    seen["loaded_first"] = _controller(engine._heterogeneous_runtime())
    _train(engine, loader, SECOND_STOP, plans, device, rank)
    seen["saved_second"] = _controller(engine._heterogeneous_runtime())
    engine.save_checkpoint(directory, tag="second")

    engine, loader = _engine(data, device)
    engine.load_checkpoint(directory, tag="second")
    seen["loaded_second"] = _controller(engine._heterogeneous_runtime())
    _train(engine, loader, STEPS, plans, device, rank)
    seen["end"] = _controller(engine._heterogeneous_runtime())
    return {"plans": plans, **seen}


@pytest.mark.multiprocess
def test_resume_in_a_verify_window_and_after_a_revert(tmp_path):
    fast, slow = run_subcases(_resumed_twice, [dict(directory=str(tmp_path / "ckpt"))], world_size=2,
                              timeout=900)[0]
    assert fast["plans"] == slow["plans"] and fast["end"]["events"] == slow["end"]["events"]
    plans = fast["plans"]  # plans[k]: the plan in force after step k + 1
    assert len(plans) == STEPS, plans
    profiled = plans[PROFILE - 1]
    assert profiled == [13, 3], plans  # 16 samples in proportion to the profiled speeds 1 : 0.25

    # Stopped two steps into the check window: the switch is pending and the resumed run is still
    # verifying it, with the two steps it already measured.
    first = fast["saved_first"]
    assert first["phase"] == "verifying" and first["pending"] == [[8, 8], profiled], first
    assert first["window"] == FIRST_STOP - PROFILE and first["startup"] == [8, 8], first
    assert fast["loaded_first"] == first, (fast["loaded_first"], first)

    # The check is due at step PROFILE + CHECK_INTERVAL, resumed or not, and goes back to the
    # start-up plan: the two profiling steps before the switch are too few to judge by, so the two
    # plans are compared on one more interval, which keeps the start-up plan.
    assert plans[PROFILE - 1:PROFILE - 1 + CHECK_INTERVAL] == [profiled] * CHECK_INTERVAL, plans
    compared = PROFILE + 2 * CHECK_INTERVAL
    assert plans[PROFILE - 1 + CHECK_INTERVAL:compared - 1] == [[8, 8]] * CHECK_INTERVAL, plans
    revert = (PROFILE + CHECK_INTERVAL, profiled, [8, 8], "revert")
    second = fast["saved_second"]
    assert second["events"] == [revert] and second["phase"] == "verifying", second
    assert second["pending"] == [profiled, [8, 8]] and second["reverted"] == [], second  # comparing

    # Resumed in the comparison's interval: it goes on with the steps it measured, and ends with
    # the start-up plan kept and the profiled one barred for RETRY_AFTER_CHECKS checks.
    assert fast["loaded_second"] == second, (fast["loaded_second"], second)
    end = fast["end"]
    assert end["events"][0] == revert and end["phase"] == "static" and end["pending"] is None, end
    # The comparison keeps the plan it measured faster, [8, 8] (rank 0 now at 0.05 takes 8 x 0.2 s
    # instead of 13 x 0.2 s); the profiled plan is barred for RETRY_AFTER_CHECKS checks.
    assert plans[-1] == [8, 8] and end["reverted"] == [(profiled, 10)], end


def _exchange_resumed(rank, world_size, directory):
    """A stock loader's equal batches (8 + 8) re-split to the profiled plan: rank 0 has measured
    what the exchange costs. Saved after profiling; a new engine loads it. What decides whether a
    later re-plan is worth its exchange (rank 0's estimate, the sizes the loader fed, the verdict
    on a candidate) must be what the uninterrupted engine holds."""
    import deepspeed
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(16 * STEPS, WIDTH, generator=generator), torch.randn(16 * STEPS, WIDTH,
                                                                                        generator=generator)
    device = VirtualDevice(SECONDS_PER_SAMPLE)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH),
                                    device.layer())
        config = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                           "profile_steps": PROFILE}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def decisions(runtime):
        candidate = _plan([12, 4])
        models = runtime.decisions.base_models
        runtime.decisions._worth_resplitting(candidate, models)
        return {"estimate": list(runtime.exchange.estimate), "note": runtime.exchange.note,
                "fed": None if runtime.exchange.fed_sizes is None else list(runtime.exchange.fed_sizes),
                "models": None if models is None else [[m.a, m.b] for m in models]}

    engine = build()
    with device.installed():
        for step in range(PROFILE + 1):
            device.speed = PROFILING_SPEEDS[rank]
            rows = slice(step * 16 + rank * 8, step * 16 + rank * 8 + 8)  # equal batches, whatever the plan
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows]))
            engine.step()
    engine.save_checkpoint(directory, tag="profiled")
    saved = decisions(engine._heterogeneous_runtime())
    fresh = decisions(build()._heterogeneous_runtime())
    resumed_engine = build()
    resumed_engine.load_checkpoint(directory, tag="profiled")
    return {"saved": saved, "resumed": decisions(resumed_engine._heterogeneous_runtime()), "fresh": fresh,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


@pytest.mark.multiprocess
def test_a_resumed_run_weighs_a_re_split_as_the_uninterrupted_one(tmp_path):
    fast, slow = run_subcases(_exchange_resumed, [dict(directory=str(tmp_path / "ckpt"))], world_size=2,
                              timeout=900)[0]
    assert fast["plan"] == [13, 3], fast["plan"]  # profiled: the loader's 8 + 8 are re-split
    saved = fast["saved"]  # rank 0: the one that decides
    assert saved["estimate"][0] is not None and saved["estimate"][1] > 0 and saved["fed"] == [8, 8], saved
    # The estimate and the fed sizes are what a later re-split verdict reads (on virtual devices the
    # exchange costs next to nothing, so the verdict itself keeps the plan either way).
    assert fast["resumed"] == saved, (fast["resumed"], saved)
    assert fast["fresh"]["estimate"] == [None, None], fast["fresh"]  # what a resume without it would hold


def _clock_by_phase(rank, world_size, strategy, dynamic):
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    heterogeneous = {"enabled": True, "load_balancing_strategy": strategy, "profile_steps": 2,
                     "scheduler": {"dynamic_rebalancing": dynamic, "check_interval": 2}}
    if strategy == "manual":
        heterogeneous["micro_batch_sizes"] = [6, 2]
    config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "heterogeneous_config": heterogeneous}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    phases = []
    for _ in range(4):
        mbs = engine.train_micro_batch_size_per_gpu()
        engine.backward(engine(torch.randn(mbs, 8)).square().mean())
        engine.step()
        runtime = engine._heterogeneous_runtime()
        phases.append((runtime.phase.value, comm_clock._timing))
    return phases


@pytest.mark.multiprocess
def test_the_comm_clock_runs_only_in_phases_that_read_it():
    manual, monitoring = run_subcases(_clock_by_phase, [dict(strategy="manual", dynamic=False),
                                                        dict(strategy="compute_aware", dynamic=True)],
                                      world_size=2, timeout=600)
    for phases in manual:
        assert phases == [("static", False)] * 4, phases
    for phases in monitoring:
        # Two profiling steps, then monitoring: timed throughout.
        assert phases == [("profiling", True), ("monitoring", True), ("monitoring", True), ("monitoring", True)], phases


def _one_more_config(rank, world_size):
    """Building a DeepSpeedConfig with the fork on only parses: both ranks build one, rank 0 one
    more (as activation checkpointing would), and no collective or settings agreement runs. The
    engine's start-up then plans once; a config rank 0 alone coordinates after it (a second
    ``zero.Init``) takes the process's cluster facts and plan: no collective, no second plan. The
    ranks' collectives stay paired and profiling agrees on a plan."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.heterogeneous import startup
    from deepspeed.runtime.heterogeneous.cluster import agreement
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    calls = []
    planner = startup.plan_micro_batches
    startup.plan_micro_batches = lambda *args, **kwargs: calls.append(1) or planner(*args, **kwargs)
    try:
        config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                           "profile_steps": 2}}
        rounds = agreement._rounds
        with recording() as parsing:
            bare = [DeepSpeedConfig(dict(config)) for _ in range(2 if rank == 0 else 1)]
        parsed = {"collectives": [str(c) for c in parsing], "agreements": agreement._rounds - rounds,
                  "plans": [c.heterogeneous.plan for c in bare], "planned": len(calls),
                  "mbs": [c.train_micro_batch_size_per_gpu for c in bare]}
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        planned = len(calls)
        one_more = None
        if rank == 0:
            with recording() as coordinating:
                later = DeepSpeedConfig(dict(config))
                later.heterogeneous.coordinate(later)
            one_more = {"collectives": [str(c) for c in coordinating], "planned": len(calls) - planned,
                        "plan": list(later.heterogeneous.plan.micro_batch_sizes)}
    finally:
        startup.plan_micro_batches = planner
    for _ in range(3):
        mbs = engine.train_micro_batch_size_per_gpu()
        engine.backward(engine(torch.randn(mbs, 8)).square().mean())
        engine.step()
    return {"plan": list(engine.heterogeneous_plan.micro_batch_sizes), "parsed": parsed, "start_up_plans": planned,
            "one_more": one_more}


@pytest.mark.multiprocess
def test_start_up_collectives_and_the_start_up_plan_run_once_per_process_and_setting():
    first, second = run_subcases(_one_more_config, [{}], world_size=2, timeout=300)[0]
    # Parsing: no collective, no settings agreement, no plan; the batch fields hold the even split.
    for result, configs in ((first, 2), (second, 1)):
        assert result["parsed"] == {"collectives": [], "agreements": 0, "plans": [None] * configs, "planned": 0,
                                    "mbs": [4] * configs}, result["parsed"]
    assert first["plan"] == second["plan"] and sum(first["plan"]) == 8, (first, second)
    # One start-up plan per process (no memory limit binds here; where one does, the plan capped
    # within it is the second, by design), and none for a config coordinated after the engine's.
    assert first["start_up_plans"] == second["start_up_plans"] == 1, (first, second)
    assert first["one_more"]["collectives"] == [] and first["one_more"]["planned"] == 0, first["one_more"]
