# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of heterogeneous runs resume exactly (deepspeed/runtime/heterogeneous/checkpoint.py).

- A run saved at step k under an uneven plan (compute_aware, after a plan change) and resumed in
  a new group of processes equals the run that was never interrupted, and every sample index of
  the epoch is fed exactly once (the dataset records what it hands out).
- Resumed on another cluster (other emulated speeds), the checkpoint's plan is kept, profiling
  runs again and the epoch goes on without repeating or dropping a sample; resumed on one rank
  instead of two (a ZeRO-0 checkpoint), the rest of the epoch is re-split.
- A checkpoint written with the fork off, or with the adaptive loss scaler, names only upstream
  classes: it unpickles in a process that imports the pristine upstream release.

The sampler's state and the scaler's checkpoint form are also tested without processes.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness import load_patchset, run_ranks, run_subcases
from references import RecordingDataset, adam_mse_reference

from deepspeed.runtime.heterogeneous.checkpoint import check_positions_agree
from deepspeed.runtime.heterogeneous.data.sampler import HeterogeneousBatchSampler, HeterogeneousDistributedSampler

WIDTH = 8
SAMPLES = 64  # one epoch = 8 steps of 8 samples: no wrap-around padding
BATCH = 8
LR = 1e-2
SAVE_AT = 4
STEPS = 8


# -- the sampler's state (no processes) -------------------------------------------------------


def _draw(samplers, steps):
    iterators = [iter(sampler) for sampler in samplers]
    return [[index for it in iterators for index in next(it)] for _ in range(steps)]


@pytest.mark.parametrize("per_rank_gas", [False, True])
def test_batch_sampler_resumes_where_it_was(per_rank_gas):
    gas = [1, 3] if per_rank_gas else None

    def make():
        return [HeterogeneousBatchSampler(range(50), [4, 2], rank=r, seed=5, gradient_accumulation_steps=gas)
                for r in range(2)]

    def per_round(rank):
        return gas[rank] if gas else 1

    # The uninterrupted run: three rounds, a change to [5, 1], then to the epoch's end.
    uninterrupted = make()
    iterators = [iter(s) for s in uninterrupted]
    fed, round_index = [], 0
    while round_index < uninterrupted[0].steps_per_epoch:  # re-read: the change alters the round count
        if round_index == 3:
            for s in uninterrupted:
                s.set_micro_batch_sizes([5, 1], gradient_accumulation_steps=gas)
        for rank, it in enumerate(iterators):
            fed += [next(it) for _ in range(per_round(rank))]
        round_index += 1
    assert all(next(it, None) is None for it in iterators)
    # Saved after round 4 (one round under the new split), resumed by new samplers.
    saving = make()
    iterators = [iter(s) for s in saving]
    before = []
    for round_index in range(4):
        if round_index == 3:
            for s in saving:
                s.set_micro_batch_sizes([5, 1], gradient_accumulation_steps=gas)
        for rank, it in enumerate(iterators):
            before += [next(it) for _ in range(per_round(rank))]
    states = [s.state_dict() for s in saving]
    assert states[0] == states[1] and states[0]["rounds_done"] == 4 and len(states[0]["segments"]) == 2
    json.dumps(states[0])  # plain values only
    resumed = [HeterogeneousBatchSampler(range(50), [5, 1], rank=r, seed=5, gradient_accumulation_steps=gas)
               for r in range(2)]
    for s in resumed:
        s.load_state_dict(states[0])
        s.set_epoch(0)  # the checkpoint's epoch keeps its position
    after = []
    iterators = [iter(s) for s in resumed]
    for _ in range(resumed[0].steps_per_epoch - 4):
        for rank, it in enumerate(iterators):
            after += [next(it) for _ in range(per_round(rank))]
    assert all(next(it, None) is None for it in iterators)
    assert before + after == fed
    assert [len(s) for s in resumed] == [(resumed[0].steps_per_epoch - 4) * per_round(r) for r in range(2)]
    # The pass after the resumed one is a whole epoch again.
    assert sum(len(b) for b in resumed[0]) + sum(len(b) for b in resumed[1]) >= 50


def test_resplit_for_another_world_size_feeds_each_index_once():
    saving = [HeterogeneousBatchSampler(range(48), [5, 3], rank=r, seed=1) for r in range(2)]
    consumed = [i for step in _draw(saving, 2) for i in step]
    state = saving[0].state_dict()
    single = HeterogeneousBatchSampler(range(48), [8], rank=0, seed=1)
    single.load_state_dict(state)
    rest = [i for batch in single for i in batch]
    assert sorted(consumed + rest) == list(range(48))
    three = [HeterogeneousDistributedSampler(range(48), [2, 3, 3], rank=r, seed=1) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    assert len(three[1]) == 3 * 4
    assert sorted(consumed + [i for s in three for i in s]) == list(range(48))


def test_two_world_changes_in_one_epoch_feed_each_index_once():
    """Saved on 2 ranks, resumed on 3, saved again and resumed on 1, all within one epoch: the
    state saved after a re-split keeps the epoch's earlier segments, so the second resume loads it
    and the epoch still feeds every index once."""
    two = [HeterogeneousBatchSampler(range(48), [5, 3], rank=r, seed=1) for r in range(2)]
    consumed = [i for step in _draw(two, 2) for i in step]
    three = [HeterogeneousBatchSampler(range(48), [2, 3, 3], rank=r, seed=1) for r in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    consumed += [i for step in _draw(three, 2) for i in step]
    state = three[0].state_dict()
    assert state == three[2].state_dict() and state["rounds_done"] == 4
    assert [seg["first_round"] for seg in state["segments"]] == [0, 2]
    one = HeterogeneousBatchSampler(range(48), [8], rank=0, seed=1)
    one.load_state_dict(state)
    rest = [i for batch in one for i in batch]
    assert sorted(consumed + rest) == list(range(48))


@pytest.mark.parametrize("key, value", [("seed", 2), ("dataset_size", 40), ("shuffle", False), ("drop_last", True)])
def test_sampler_state_from_another_setup_is_refused(key, value):
    state = HeterogeneousBatchSampler(range(48), [5, 3], rank=0, seed=1).state_dict()
    kwargs = {"seed": 1, "shuffle": True, "drop_last": False, key: value}
    size = value if key == "dataset_size" else 48
    other = HeterogeneousBatchSampler(range(size), [5, 3], rank=0, **{k: v for k, v in kwargs.items()
                                                                      if k != "dataset_size"})
    with pytest.raises(ValueError, match=f"{key} is .* in the checkpoint but"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="rounds_done = 99 must be an integer in 0..6"):
        HeterogeneousBatchSampler(range(48), [5, 3], rank=0, seed=1).load_state_dict({**state, "rounds_done": 99})


def test_positions_that_differ_between_ranks_are_refused():
    samplers = [HeterogeneousBatchSampler(range(48), [5, 3], rank=r) for r in range(2)]
    next(iter(samplers[0]))  # rank 0 fetched a round ahead
    with pytest.raises(ValueError, match="rank 0: epoch 0 round 1, rank 1: epoch 0 round 0"):
        check_positions_agree([[s.state_dict()] for s in samplers])


def test_a_round_begun_but_not_finished_is_handed_out_again():
    sampler = HeterogeneousBatchSampler(range(40), [4, 2], rank=1, shuffle=False, gradient_accumulation_steps=[1, 3])
    iterator = iter(sampler)
    assert next(iterator) == [4, 5] and sampler.mid_round and sampler.rounds_done == 0
    next(iterator), next(iterator)
    assert not sampler.mid_round and sampler.rounds_done == 1
    resumed = HeterogeneousBatchSampler(range(40), [4, 2], rank=1, shuffle=False, gradient_accumulation_steps=[1, 3])
    resumed.load_state_dict({**sampler.state_dict(), "rounds_done": 0})
    assert next(iter(resumed)) == [4, 5]


def test_adaptive_scaler_is_stored_as_an_upstream_scaler_and_restored():
    from deepspeed.runtime.fp16.adaptive_scaler import AdaptiveLossScaler, loaded_loss_scaler, saved_loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    args = dict(init_scale=2.0**16, scale_window=100, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False)
    scaler = AdaptiveLossScaler(0.5, **args)
    for value in (0.25, 3.0, 0.5):
        scaler.observe(torch.tensor([0.0, value * scaler.cur_scale]))
        scaler.update_scale(False)
    scaler.update_scale(True)
    stored = saved_loss_scaler(scaler)
    assert type(stored) is DynamicLossScaler and stored.cur_scale == scaler.cur_scale
    assert stored.cur_iter == scaler.cur_iter and not hasattr(stored, "history")
    fresh = AdaptiveLossScaler(0.5, **args)
    restored = loaded_loss_scaler(stored, fresh)
    assert type(restored) is AdaptiveLossScaler and restored.state_dict() == scaler.state_dict()
    plain = DynamicLossScaler(**args)
    assert saved_loss_scaler(plain) is plain and loaded_loss_scaler(plain, plain) is plain
    plain.cur_scale = 8.0
    assert loaded_loss_scaler(plain, fresh).cur_scale == 8.0  # an upstream checkpoint: its scale, adaptive on


def test_rebalancer_state_round_trip():
    from deepspeed.runtime.heterogeneous.planning.planner import TimeModel
    from deepspeed.runtime.heterogeneous.planning.rebalance import RebalancePolicy, Rebalancer
    saved = Rebalancer(RebalancePolicy(0.1, cooldown_checks=2))
    saved.plan_chosen([TimeModel(0.01, 0.002), TimeModel(0.02, 0.004)])
    saved.baseline = [(0.1, 0.01), (0.2, 0.02)]
    saved.policy.streak, saved.policy.cooldown, saved.policy.events = 1, 2, 3
    state = saved.state_dict()
    json.dumps(state)
    resumed = Rebalancer(RebalancePolicy(0.2, cooldown_checks=5))
    resumed.load_state_dict(state)
    assert resumed.reference_models == saved.reference_models and resumed.baseline == saved.baseline
    assert (resumed.policy.streak, resumed.policy.cooldown, resumed.policy.events) == (1, 2, 3)
    assert (resumed.policy.threshold, resumed.policy.cooldown_checks) == (0.2, 5)  # the new config's settings


# -- real runs --------------------------------------------------------------------------------


def recording_dataset():
    return RecordingDataset(SAMPLES, WIDTH, seed=3)


def make_model():
    torch.manual_seed(20261201)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(), torch.nn.Linear(16, WIDTH))


def hetero_config(stage=0, speeds=None, profile_steps=0):
    heterogeneous = {"enabled": True, "load_balancing_strategy": "compute_aware", "profile_steps": profile_steps,
                     "mixed_precision_support": "fp32"}
    if speeds is not None:
        heterogeneous["emulation"] = {"speeds": speeds, "mode": "dilation"}
    return {
        "train_batch_size": BATCH,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "heterogeneous_config": heterogeneous,
    }


def _train(rank, world_size, config, steps, save=None, load=None, reschedule_at=None):
    """Train ``steps`` steps on the engine's own loader; returns what each step fed, the plans and
    the parameters."""
    import deepspeed

    dataset = recording_dataset()
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset)
    after_load = None
    if load is not None:
        load_path, client_state = engine.load_checkpoint(load)
        assert load_path is not None and client_state.get("user") == "kept", client_state
        assert "deepspeed_hetero" not in client_state  # the fork's record is not the user's
        runtime = engine._heterogeneous_runtime()
        after_load = {"plan": list(engine.heterogeneous_plan.micro_batch_sizes), "profiling": runtime.profiling,
                      "global_steps": engine.global_steps}
    iterator = iter(loader)
    fed, plans = [], []
    for step in range(steps):
        if reschedule_at is not None and engine.global_steps == reschedule_at:
            engine.reschedule_workload(utilization_metrics=[1.0, 3.0])  # rank 1 three times slower: [6, 2]
        start = len(dataset.seen)
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(iterator)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
        fed.append(dataset.seen[start:])
        plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
    if save is not None:
        engine.save_checkpoint(save, client_state={"user": "kept"})
    runtime = engine._heterogeneous_runtime()
    return {"fed": fed, "plans": plans, "after_load": after_load, "history": len(runtime.decisions.history),
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def _global_steps(per_rank):
    """Per step, the indices every rank fed (rank order)."""
    return [[i for rank in per_rank for i in rank["fed"][step]] for step in range(len(per_rank[0]["fed"]))]


def _reference(step_indices):
    dataset = recording_dataset()
    return adam_mse_reference(make_model(), dataset.inputs, dataset.targets, step_indices, LR)


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """One group of two ranks: the uninterrupted run, and the runs that save at step SAVE_AT."""
    root = tmp_path_factory.mktemp("checkpoints")
    cases = [
        dict(config=hetero_config(), steps=STEPS, reschedule_at=2),
        dict(config=hetero_config(), steps=SAVE_AT, reschedule_at=2, save=str(root / "uneven")),
        # Profiling, then a plan change the test controls (what profiling decides depends on timing).
        dict(config=hetero_config(speeds=[1.0, 0.4], profile_steps=2), steps=SAVE_AT, reschedule_at=3,
             save=str(root / "cluster")),
    ]
    results = run_subcases(_train, cases, world_size=2, timeout=600)
    return root, results


@pytest.mark.multiprocess
def test_resumed_run_equals_the_uninterrupted_run(saved_runs):
    root, (uninterrupted, first, _) = saved_runs
    assert first[0]["plans"][-1] == [6, 2], "the plan must be uneven and changed before the save"
    (resumed,) = run_subcases(_train, [dict(config=hetero_config(), steps=STEPS - SAVE_AT,
                                            load=str(root / "uneven"))], world_size=2, timeout=300)
    steps = _global_steps(first) + _global_steps(resumed)
    assert sorted(i for step in steps for i in step) == list(range(SAMPLES)), "every index once per epoch"
    assert steps == _global_steps(uninterrupted)
    assert resumed[0]["after_load"] == {"plan": [6, 2], "profiling": False, "global_steps": SAVE_AT}
    for rank in range(2):
        for got, want in zip(resumed[rank]["params"], uninterrupted[rank]["params"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(resumed[0]["params"], _reference(steps)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
def test_resume_on_another_cluster_and_on_one_rank(saved_runs):
    root, (_, first, profiled) = saved_runs
    # Other emulated speeds: the checkpoint's plan, then profiling again from it.
    saved_plan = profiled[0]["plans"][-1]
    assert saved_plan == [6, 2] and profiled[0]["history"] == 2
    resume = dict(config=hetero_config(speeds=[0.4, 1.0], profile_steps=2), steps=STEPS - SAVE_AT,
                  load=str(root / "cluster"))
    (other,) = run_subcases(_train, [resume], world_size=2, timeout=300)
    assert other[0]["after_load"] == {"plan": saved_plan, "profiling": True, "global_steps": SAVE_AT}
    assert other[0]["history"] == 2, "profiling ran again on the new cluster"
    steps = _global_steps(profiled) + _global_steps(other)
    assert sorted(i for step in steps for i in step) == list(range(SAMPLES))
    for got, want in zip(other[0]["params"], _reference(steps)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # One rank instead of two (ZeRO-0): the rest of the epoch re-split for one rank.
    (single,) = run_ranks(_train, world_size=1, timeout=300,
                          args=(hetero_config(), STEPS - SAVE_AT, None, str(root / "uneven")))
    assert single["after_load"]["plan"] == [BATCH]
    steps = _global_steps(first) + _global_steps([single])
    assert sorted(i for step in steps for i in step) == list(range(SAMPLES))
    for got, want in zip(single["params"], _reference(steps)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- checkpoints that upstream can load -------------------------------------------------------


def _save_fp16(rank, world_size, stage, fork, out):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True  # torch's CPU kernels run fp16
    config = {"train_batch_size": BATCH, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "fp16": {"enabled": True, "initial_scale_power": 8}}
    if fork:
        config["fp16"]["auto_scale_threshold"] = 0.5
        config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "manual",
                                          "micro_batch_sizes": [5, 3]}
    else:
        config["train_micro_batch_size_per_gpu"] = BATCH // world_size
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dataset = recording_dataset()
    size = engine.train_micro_batch_size_per_gpu()
    for step in range(3):
        inputs, targets = dataset.inputs[:size].half(), dataset.targets[:size].half()
        engine.backward(torch.nn.functional.mse_loss(engine(inputs).float(), targets.float()))
        engine.step()
    engine.save_checkpoint(out)
    scaler = getattr(engine.optimizer, "adaptive_scaler", None) or engine.optimizer.loss_scaler
    summary = {"class": type(scaler).__name__, "scale": scaler.cur_scale}
    if fork:  # a fresh engine loads it back: the adaptive scaler with the same state
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.load_checkpoint(out)
        loaded = getattr(engine.optimizer, "adaptive_scaler", None) or engine.optimizer.loss_scaler
        summary["loaded"] = {"class": type(loaded).__name__, "state": loaded.state_dict()}
        summary["state"] = scaler.state_dict()
    return summary


UNPICKLE = r"""
import glob, json, os, pickle, sys, types
import torch
import deepspeed
root = os.path.realpath(sys.argv[1])
assert os.path.realpath(deepspeed.__file__).startswith(root), deepspeed.__file__
found = {}
class Recording(pickle.Unpickler):
    def find_class(self, module, name):
        value = super().find_class(module, name)
        source = getattr(sys.modules.get(module), "__file__", None) or ""
        found[f"{module}.{name}"] = os.path.realpath(source).startswith(root) or not module.startswith("deepspeed")
        return value
files = sorted(glob.glob(os.path.join(sys.argv[2], "**", "*.pt"), recursive=True))
for path in files:
    torch.load(path, map_location="cpu", weights_only=False,
               pickle_module=types.SimpleNamespace(Unpickler=Recording, load=pickle.load, __name__="pickle"))
print(json.dumps({"files": len(files), "classes": found}))
"""


@pytest.mark.multiprocess
def test_checkpoints_unpickle_in_pristine_upstream(tmp_path, saved_runs):
    """With the fork off, and also with the adaptive scaler and the fork's record, a checkpoint
    names only upstream classes, so the pinned upstream release loads it."""
    patchset = load_patchset()
    tree = tmp_path / "upstream"
    patchset.write_tree(patchset.pristine_tree(patchset.read_pin()), tree)
    cases = [dict(stage=1, fork=False, out=str(tmp_path / "off-zero1")),
             dict(stage=0, fork=True, out=str(tmp_path / "adaptive-zero0")),
             dict(stage=1, fork=True, out=str(tmp_path / "adaptive-zero1")),
             dict(stage=3, fork=True, out=str(tmp_path / "adaptive-zero3"))]
    results = run_subcases(_save_fp16, cases, world_size=2, timeout=600)
    for case, (summary, _) in zip(cases, results):
        if case["fork"]:
            assert summary["class"] == "AdaptiveLossScaler" and summary["loaded"]["class"] == "AdaptiveLossScaler"
            assert summary["loaded"]["state"] == summary["state"], case
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), DS_ACCELERATOR="cpu")
    # The fork's record (plan, sampler positions, runtime) is plain values too.
    cases.append(dict(stage=0, fork=True, out=str(saved_runs[0] / "uneven")))
    for case in cases:
        done = subprocess.run([sys.executable, "-c", UNPICKLE, str(tree), case["out"]], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{case}: upstream could not load the checkpoint:\n{done.stderr[-4000:]}"
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["files"] >= (1 if case["stage"] == 0 else 3), (case, report)
        foreign = [name for name, upstream in report["classes"].items() if not upstream]
        assert not foreign, f"{case}: classes outside upstream {foreign}"
        assert not any("heterogeneous" in name or "adaptive" in name for name in report["classes"]), report
