# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous pipeline parallelism: stages sized to their devices, uneven replicas, exact.

The partition arithmetic is checked against brute force; the pipeline runs (2 stages, and 2
stages x 2 replicas with ZeRO-1, activation checkpointing on and off; fed by the engine's loader
and by the user's own iterator) against one process training the same layers on the global batch.
The collectives each rank issues are recorded and compared: in the steps, and at every point
outside a step where the fork issues some (start-up, checkpoints)."""

import itertools
import json
import random

import pytest
import torch

from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
from deepspeed.runtime.heterogeneous.planning.stages import (StagePartitionError, balanced_bound, manual_partition,
                                                             partition_stages, replica_sample_times, stage_speeds)
from harness import run_subcases

# -- the partition ---------------------------------------------------------------------------------


def test_a_half_speed_stage_gets_half_the_layers_of_a_full_speed_one():
    result = partition_stages([1.0] * 12, [1.0, 0.5])
    assert result.layers_per_stage == (8, 4) and result.stage_times == (8.0, 8.0)
    assert partition_stages([1.0] * 12, [1.0, 1.0]).layers_per_stage == (6, 6)
    # Three stages at [1.0, 0.5, 0.5]: 6 + 3 + 3 layers, every stage 6 per sample.
    assert partition_stages([1.0] * 12, [1.0, 0.5, 0.5]).layers_per_stage == (6, 3, 3)


def _brute_force(costs, speeds, layer_bytes=None, capacity=None):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), len(speeds) - 1):
        parts = (0, *cuts, len(costs))
        if capacity is not None and any(c is not None and sum(layer_bytes[a:b]) > c
                                        for a, b, c in zip(parts, parts[1:], capacity)):
            continue
        value = max(sum(costs[a:b]) / s for a, b, s in zip(parts, parts[1:], speeds))
        if best is None or value < best:
            best = value
    return best


def test_the_partition_is_the_least_bottleneck_of_all_contiguous_ones():
    rng = random.Random(7)
    for _ in range(300):
        layers, stages = rng.randint(2, 9), rng.randint(1, 4)
        if stages > layers:
            continue
        costs = [rng.choice([0.0, 1.0, 2.0, 5.0, rng.random()]) for _ in range(layers)]
        speeds = [rng.choice([1.0, 0.5, 0.25, rng.uniform(0.1, 1.0)]) for _ in range(stages)]
        result = partition_stages(costs, speeds)
        assert result.bottleneck == pytest.approx(_brute_force(costs, speeds), rel=1e-12)
        assert result.parts[0] == 0 and result.parts[-1] == layers and min(result.layers_per_stage) >= 1


def test_the_partition_keeps_each_stage_within_its_memory():
    costs = [1.0] * 8
    layer_bytes = [10.0] * 8
    assert partition_stages(costs, [1.0, 0.5]).bottleneck == 6.0  # 5 or 6 layers on the fast stage
    # The fast stage holds only 40 bytes: 4 layers, and the slow stage's 4 take 8 per sample.
    result = partition_stages(costs, [1.0, 0.5], layer_bytes, [40.0, None])
    assert result.layers_per_stage == (4, 4) and result.bottleneck == 8.0
    assert result.bottleneck == _brute_force(costs, [1.0, 0.5], layer_bytes, [40.0, None])
    with pytest.raises(StagePartitionError, match="use more stages, or give the stages more memory"):
        partition_stages(costs, [1.0, 0.5], layer_bytes, [30.0, 30.0])


def test_bad_partitions_are_refused_with_what_is_allowed():
    with pytest.raises(StagePartitionError, match="3 layer\\(s\\) cannot fill 4 pipeline stages"):
        partition_stages([1.0] * 3, [1.0] * 4)
    with pytest.raises(StagePartitionError, match="stage_layers \\[4, 4\\] must give each of the 2 stages"):
        manual_partition([4, 4], [1.0] * 12, [1.0, 0.5])
    assert manual_partition([9, 3], [1.0] * 12, [1.0, 0.5]).stage_times == (9.0, 6.0)


def test_stage_speeds_replica_times_and_the_balanced_bound():
    # Global ranks (stage, replica): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1); replica 1 at half speed.
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    speeds = [1.0, 0.5, 1.0, 0.5]
    assert stage_speeds(speeds, [c[0] for c in coords], 2) == [0.5, 0.5]
    partition = partition_stages([1.0] * 12, [0.5, 0.5])
    assert replica_sample_times(partition, [1.0] * 12, speeds, coords, 2) == [6.0, 12.0]
    # 12 units over speeds 1.0 + 0.5, 4 micro-batches through 2 stages: (4 + 1) / 4 of 8.
    assert balanced_bound([1.0] * 12, [1.0, 0.5], 4) == pytest.approx(10.0)


def test_emulation_lists_are_per_global_rank_with_a_pipeline():
    config = {"heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.5]}}}
    with pytest.raises(ValueError, match="the job has 4 processes; with pipeline or model parallelism \\(4 processes, "
                       "2 data-parallel replica\\(s\\)\\) the emulation gives one entry per global rank"):
        load_heterogeneous_settings(dict(config), world_size=2, process_count=4)
    config["heterogeneous_config"]["emulation"]["speeds"] = [1.0, 0.5, 1.0, 0.5]
    assert load_heterogeneous_settings(dict(config), world_size=2, process_count=4).config.emulation.speeds[3] == 0.5


# -- pipelines against one process -----------------------------------------------------------------

WIDTH, BLOCKS, BATCH, STEPS, LR = 8, 6, 16, 3, 0.1


def _layers():
    torch.manual_seed(1)
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return layers


def _data(size):
    generator = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randn(size, WIDTH, generator=generator),
                                          torch.randn(size, WIDTH, generator=generator))


def _config(heterogeneous, zero=0):
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": zero},
            "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "heterogeneous_config": {"enabled": True, **heterogeneous}}


def _pipeline(rank, world_size, heterogeneous, stages=2, zero=0, checkpoint_interval=0,
              partition_method="heterogeneous", eager_parameters=True, layers=None, bf16=False, extra=None,
              data_iter=False):
    """``data_iter``: the caller's own iterator feeds ``train_batch(data_iter=...)`` (no
    ``training_data``, so no loader of the engine's); else the engine's loader."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    net = PipelineModule(layers=_uneven_layers() if layers == "uneven" else _layers(), num_stages=stages,
                         loss_fn=torch.nn.MSELoss(),
                         partition_method=partition_method, activation_checkpoint_interval=checkpoint_interval)
    parameters = [p for p in net.parameters() if p.requires_grad] if eager_parameters else net.parameters()
    config, data = _config(heterogeneous, zero), _data(BATCH * (STEPS + 1))
    config.update(extra or {})
    if bf16:  # the pipeline feeds its inputs as they come: in the model's dtype
        config["bf16"] = {"enabled": True}
        data = torch.utils.data.TensorDataset(*(t.bfloat16() for t in data.tensors))
    if data_iter:
        engine = deepspeed.initialize(model=net, model_parameters=parameters, config=config)[0]
        batches = _users_batches(engine, data)
        losses = [float(engine.train_batch(data_iter=batches)) for _ in range(STEPS)]
    else:
        engine = deepspeed.initialize(model=net, model_parameters=parameters, config=config, training_data=data)[0]
        losses = [float(engine.train_batch()) for _ in range(STEPS)]
    return {"losses": losses, "parts": [int(p) for p in net.parts], "stage": engine.stage_id,
            "cost_unit": engine._config.heterogeneous.pipeline.cost_unit,
            "layer_costs": list(engine._config.heterogeneous.pipeline.layer_costs),
            "stage_speeds": list(engine._config.heterogeneous.pipeline.stage_speeds),
            "sizes": list(engine.heterogeneous_plan.micro_batch_sizes),
            "state": {key: value.detach().float().clone() for key, value in engine.module.state_dict().items()}}


def _users_batches(engine, data):
    """A user's iterator: the micro-batches in order, as a plain DataLoader gives them (one replica,
    so the replica's micro-batch is the plan's only one)."""
    return iter(torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu()))


def _reference(layers=None):
    """One process, the same layers, the global batch in loader order."""
    model = torch.nn.Sequential(*(layers or _layers()))
    inputs, targets = _data(BATCH * (STEPS + 1)).tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _assert_exact(results, atol=1e-6, layers=None):
    losses, state = _reference(layers)
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=atol), (result["losses"], losses)
        for key, value in result["state"].items():  # PipelineModule names a layer by its global index
            torch.testing.assert_close(value, state[key], rtol=0, atol=atol)


@pytest.mark.multiprocess
def test_two_stages_on_mixed_speeds_are_sized_to_them_and_exact():
    dilation = {"emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}, "pipeline": {"layer_cost": "parameters"}}
    cases = [
        dict(heterogeneous=dilation),
        dict(heterogeneous=dilation, checkpoint_interval=1),
        # A lazy parameter generator is read after the build.
        dict(heterogeneous=dilation, eager_parameters=False),
        dict(heterogeneous={**dilation, "pipeline": {"stage_layers": [9, 3]}}),
        # Measured layer costs (the default): the partition depends on the timings; exact all the same.
        dict(heterogeneous={"emulation": dilation["emulation"]}),
        # Upstream's partition, the fork on: its stages stay, and training stays exact.
        dict(heterogeneous=dilation, partition_method="parameters"),
        # Upstream's cuts chosen in the config (the autotuner compares them without editing the script).
        dict(heterogeneous={**dilation, "pipeline": {"layer_cost": "parameters", "partition": "parameters"}}),
        dict(heterogeneous={**dilation, "pipeline": {"layer_cost": "parameters", "partition": "uniform"}}),
        # The engine's backward timers on a stage other than the last (upstream 0.19.8 failed at the
        # second micro-batch: "timer has already been started"; autotuning turns them on too).
        dict(heterogeneous=dilation, extra={"wall_clock_breakdown": True, "steps_per_print": 1}),
    ]
    results = run_subcases(_pipeline, cases, world_size=2, timeout=600)
    # 6 x (Linear, Tanh): the full-speed stage takes 4 linear layers, the half-speed one 2.
    for case in results[:3]:
        assert [r["parts"] for r in case] == [[0, 7, 12]] * 2
    assert [r["parts"] for r in results[3]] == [[0, 9, 12]] * 2
    assert results[4][0]["cost_unit"] == "forward + backward seconds, timed on 2 rank(s)"
    assert results[4][0]["parts"] == results[4][1]["parts"]
    assert [r["parts"] for r in results[5]] == [[0, 6, 12]] * 2
    assert [r["parts"] for r in results[6]] == [r["parts"] for r in results[5]]
    assert [r["parts"] for r in results[7]] == [[0, 6, 12]] * 2
    assert [r["parts"] for r in results[8]] == [[0, 7, 12]] * 2
    for case in results:
        _assert_exact(case)


@pytest.mark.multiprocess
def test_a_pipeline_fed_by_the_users_iterator_trains_exactly_and_ends():
    """Two stages at speeds [1.0, 0.5] fed through ``train_batch(data_iter=...)``, the other way
    DeepSpeed's pipeline docs show. The runtime controller's construction runs the emulation's
    speed check, a gather over every rank: it must run where every stage is, as the engine is built,
    since at the first forward only the first stage would reach it while the second waits for its
    activations. With strategy uniform too, and through ``training_data=`` for comparison: all exact."""
    dilation = {"emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}, "pipeline": {"layer_cost": "parameters"}}
    cases = [
        dict(heterogeneous=dilation, data_iter=True),
        dict(heterogeneous={**dilation, "load_balancing_strategy": "uniform"}, data_iter=True),
        dict(heterogeneous=dilation),
    ]
    results = run_subcases(_pipeline, cases, world_size=2, timeout=600)
    for case in results:
        assert [r["parts"] for r in case] == [[0, 7, 12]] * 2
        _assert_exact(case)


class _Repeated(torch.nn.Module):
    """Few parameters, much compute: one small linear layer applied ``times`` times."""

    def __init__(self, times):
        super().__init__()
        self.linear, self.times = torch.nn.Linear(WIDTH, WIDTH), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.linear(x))
        return x


def _uneven_layers():
    torch.manual_seed(3)
    return [_Repeated(200)] + [torch.nn.Linear(WIDTH, WIDTH) for _ in range(6)]


def test_a_layer_costing_more_than_the_rest_together_gets_a_stage_of_its_own():
    """The costs a probe of the uneven layers gives (the first applies its linear layer 200 times):
    weighed by them the first layer is a stage alone; weighed by parameters, seven equal layers
    are cut 3 + 4."""
    assert list(partition_stages([200.0] + [1.0] * 6, [1.0, 1.0]).parts) == [0, 1, 7]
    assert list(partition_stages([72.0] * 7, [1.0, 1.0]).parts) == [0, 3, 7]


@pytest.mark.multiprocess
def test_measured_layer_costs_decide_the_partition_and_keep_training_exact():
    """Seven layers of 72 parameters each; the first applies its linear layer 200 times. Timed,
    every rank partitions by the costs the ranks agreed on (which way a timing falls is the pure
    test's question above); weighed by parameters, the cut is 3 + 4. Both train exactly."""
    cases = [dict(heterogeneous={"pipeline": {"layer_cost": cost}}, layers="uneven") for cost in ("measured",
                                                                                                 "parameters")]
    measured, counted = run_subcases(_pipeline, cases, world_size=2, timeout=600)
    for result in measured:
        assert result["cost_unit"] == "forward + backward seconds, timed on 2 rank(s)", result["cost_unit"]
        assert result["layer_costs"] == measured[0]["layer_costs"], "every rank must hold the same costs"
        assert all(cost > 0 for cost in result["layer_costs"]), result["layer_costs"]
        assert result["parts"] == list(partition_stages(result["layer_costs"], result["stage_speeds"]).parts), result
    assert [r["parts"] for r in counted] == [[0, 3, 7]] * 2
    for case in (measured, counted):
        _assert_exact(case, layers=_uneven_layers())


@pytest.mark.multiprocess
def test_two_stages_by_two_uneven_replicas_with_zero1_are_exact():
    # Global ranks (stage, replica): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1): replica 1 runs at half
    # speed on both stages, so it gets a third of the batch's micro-batch: [6, 2] of 8 per micro-step.
    slow_replica = {"emulation": {"speeds": [1.0, 0.5, 1.0, 0.5], "mode": "dilation"}}
    cases = [
        dict(heterogeneous=slow_replica, zero=1),
        dict(heterogeneous=slow_replica, zero=1, checkpoint_interval=2),
        dict(heterogeneous={"load_balancing_strategy": "manual", "micro_batch_sizes": [3, 5]}, zero=0),
        dict(heterogeneous=slow_replica, zero=1, bf16=True),
    ]
    results = run_subcases(_pipeline, cases, world_size=4, timeout=600)
    assert [r["sizes"] for r in results[0]] == [[6, 2]] * 4
    assert [r["sizes"] for r in results[2]] == [[3, 5]] * 4
    for case in results[:3]:
        _assert_exact(case)
    # bf16 (upstream's BF16_Optimizer, fp32 master weights): within bf16 rounding of the fp32 run, a
    # few units of bf16's 2**-8 relative spacing at the parameters' magnitude.
    assert [r["sizes"] for r in results[3]] == [[6, 2]] * 4
    losses, state = _reference()
    scale = max(value.abs().max().item() for value in state.values())
    for result in results[3]:
        assert result["losses"] == pytest.approx(losses, rel=2**-6)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=4 * 2**-8 * scale)


def _refused(rank, world_size, heterogeneous, enabled=True):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    net = PipelineModule(layers=_layers(), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="heterogeneous")
    config = _config(heterogeneous)
    config["heterogeneous_config"]["enabled"] = enabled
    try:
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
def test_what_a_pipeline_cannot_do_is_refused_by_name():
    cases = [
        dict(heterogeneous={}, enabled=False),
        dict(heterogeneous={"scheduler": {"dynamic_rebalancing": True}}),
        dict(heterogeneous={"emulation": {"speeds": [1.0]}}),
        dict(heterogeneous={"pipeline": {"stage_layers": [12]}}),
    ]
    off, rebalancing, speeds, layers = [case[0] for case in run_subcases(_refused, cases, world_size=2, timeout=300)]
    assert "partition_method='heterogeneous') needs heterogeneous_config.enabled: true" in off
    assert "dynamic_rebalancing is not supported with a PipelineModule" in rebalancing
    assert "emulation.speeds has 1 entries but the job has 2 processes" in speeds
    assert "stage_layers [12] must give each of the 2 stages at least one layer" in layers


def _resume(rank, world_size, heterogeneous, save_dir, resume_layers=None, first_layers=None, zero=0, adam=False,
            bf16=False):
    """Train 3 steps, saving after step 2; then a new engine loads that checkpoint and trains step
    3 again. ``first_layers``, ``resume_layers``: each run's stage_layers (None: the cut from the
    speeds). Returns the losses, the resumed step's loss, and each run's parameters after step 3."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    def engine(layers_per_stage=None):
        net = PipelineModule(layers=_layers(), num_stages=2, loss_fn=torch.nn.MSELoss(),
                             partition_method="heterogeneous")
        config = _config(json.loads(json.dumps(heterogeneous)), zero)
        if adam:  # state the layers carry between stages: the step count and two moments per parameter;
            # a warm-up schedule: the lr in force must come back with them
            config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
            config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                  "warmup_num_steps": 10}}
        if layers_per_stage:
            config["heterogeneous_config"].setdefault("pipeline", {})["stage_layers"] = layers_per_stage
        data = _data(BATCH * (STEPS + 1))
        if bf16:  # upstream's BF16_Optimizer: fp32 master weights and state in flat partitions
            config["bf16"] = {"enabled": True}
            data = torch.utils.data.TensorDataset(*(t.bfloat16() for t in data.tensors))
        return deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                    training_data=data)[0]

    def parameters(model):
        return {key: value.detach().clone() for key, value in model.module.state_dict().items()}

    first = engine(first_layers)
    losses = [float(first.train_batch()) for _ in range(2)]
    first.save_checkpoint(save_dir, tag="two")
    losses.append(float(first.train_batch()))
    resumed = engine(resume_layers)
    try:
        resumed.load_checkpoint(save_dir, tag="two")
    except ValueError as error:
        return {"error": str(error)}
    return {"losses": losses, "resumed": float(resumed.train_batch()), "first": parameters(first),
            "after": parameters(resumed), "parts": [int(p) for p in resumed.module.parts]}


def _merged(results, key):
    merged = {}
    for result in results:
        merged.update(result[key])
    return merged


@pytest.mark.multiprocess
def test_a_pipeline_resumes_exactly_into_the_same_stages(tmp_path):
    speeds = {"emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}, "pipeline": {"layer_cost": "parameters"}}
    cases = [dict(heterogeneous=speeds, save_dir=str(tmp_path / "same")),
             dict(heterogeneous={**speeds, "pipeline": {"layer_cost": "parameters", "save_layer_states": False}},
                  save_dir=str(tmp_path / "other"), resume_layers=[6, 6])]
    same, other = run_subcases(_resume, cases, world_size=2, timeout=600)
    for result in same:
        assert result["resumed"] == result["losses"][2], result
        assert all(torch.equal(value, result["first"][key]) for key, value in result["after"].items())
    for result in other:
        assert ("the checkpoint was saved by pipeline stages of [7, 5] layers, and this run cut [6, 6]; its optimizer "
                "state was saved by stage only (heterogeneous_config.pipeline.save_layer_states was false), so it "
                "resumes only into its own cut: set heterogeneous_config.pipeline.stage_layers to [7, 5]"
                in result["error"]), result


@pytest.mark.multiprocess
def test_a_checkpoint_loads_into_another_cut_with_its_optimizer_state(tmp_path):
    """Adam's state moves with its layers: the step after the resume equals the uninterrupted
    run's, for 2 stages ([7, 5] -> [9, 3]), fp32 and bf16 (upstream's BF16_Optimizer: its flat fp32
    master weights and state), and for 2 stages x 2 replicas under ZeRO-1 ([7, 5] -> [4, 8], the
    state assembled from both replicas' partitions)."""
    speeds = {"emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}, "pipeline": {"layer_cost": "parameters"}}
    two, bf16 = run_subcases(_resume, [
        dict(heterogeneous=speeds, save_dir=str(tmp_path / "two"), resume_layers=[9, 3], adam=True),
        dict(heterogeneous=speeds, save_dir=str(tmp_path / "bf16"), resume_layers=[9, 3], adam=True, bf16=True)
    ], world_size=2, timeout=600)
    four = run_subcases(_resume, [dict(heterogeneous={}, save_dir=str(tmp_path / "four"), first_layers=[7, 5],
                                       resume_layers=[4, 8], adam=True, zero=1)], world_size=4, timeout=600)[0]
    for results, parts in ((two, [0, 9, 12]), (four, [0, 4, 12]), (bf16, [0, 9, 12])):
        first, after = _merged(results, "first"), _merged(results, "after")
        assert sorted(first) == sorted(after)
        for result in results:
            assert result["parts"] == parts
            assert result["resumed"] == pytest.approx(result["losses"][2], abs=1e-6), result
        for key, value in after.items():
            torch.testing.assert_close(value, first[key], rtol=0, atol=1e-6)


def _regrouped(rank, world_size, save_dir, save):
    """2 stages under ZeRO-1 with Adam; ``save``: 2 replicas train 3 steps, saving after step 2;
    else 1 replica loads that checkpoint and trains step 3."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    net = PipelineModule(layers=_layers(), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="heterogeneous")
    config = _config({"pipeline": {"stage_layers": [7, 5]}}, zero=1)
    config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
    engine = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                  training_data=_data(BATCH * (STEPS + 1)))[0]
    if save is True:
        losses = [float(engine.train_batch()) for _ in range(2)]
        engine.save_checkpoint(save_dir, tag="two")
        losses.append(float(engine.train_batch()))
    else:
        engine.load_checkpoint(save_dir, tag="two")
        if save == "again":  # saved before any step of the resumed run: ZeRO re-made its fragments at the load
            engine.save_checkpoint(save_dir, tag="again")
        losses = [float(engine.train_batch())]
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}


@pytest.mark.multiprocess
def test_a_zero1_pipeline_checkpoint_loads_into_another_number_of_replicas(tmp_path):
    """Upstream refuses a ZeRO checkpoint of another data-parallel size; the layers' whole state
    loads into 1 replica from 2 (each stage's state had been partitioned over both)."""
    save_dir = str(tmp_path / "regroup")
    saved = run_subcases(_regrouped, [dict(save_dir=save_dir, save=True)], world_size=4, timeout=600)[0]
    loaded = run_subcases(_regrouped, [dict(save_dir=save_dir, save=False)], world_size=2, timeout=600)[0]
    # The same cut and replicas (upstream's load), saved again at once: every replica assembles the
    # same state tensors (a key missing on some would leave the others in an all-reduce).
    again = run_subcases(_regrouped, [dict(save_dir=save_dir, save="again")], world_size=4, timeout=600)[0]
    first = _merged(saved, "state")
    for results in (loaded, again):
        assert results[0]["losses"][0] == pytest.approx(saved[0]["losses"][2], abs=1e-6)
        after = _merged(results, "state")
        assert sorted(first) == sorted(after)
        for key, value in after.items():
            torch.testing.assert_close(value, first[key], rtol=0, atol=1e-6)


def _load_agreement(rank, world_size, save_dir):
    """What each rank's load ends in when one rank's part fails (a TypeError), and when the
    checkpoint directory is node-local: rank 0's holds the manifest and its stage's layer states,
    rank 1's neither. A stand-in engine of one stage, [0, 2, 4] here and [0, 3, 4] when saved."""
    import os
    from types import SimpleNamespace
    from deepspeed.runtime.heterogeneous.pipeline import checkpoint

    def fails_on_rank_1():
        if rank == 1:
            raise TypeError("an unexpected failure")
        return 0

    try:
        checkpoint._agreed(fails_on_rank_1, "moving the layers' optimizer state")
        failure = None
    except ValueError as exc:
        failure = str(exc)
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    engine = SimpleNamespace(
        _config=SimpleNamespace(heterogeneous=SimpleNamespace(
            pipeline=SimpleNamespace(partition=SimpleNamespace(parts=[0, 2, 4])))),
        load_universal_checkpoint=lambda: False, zero_optimization=lambda: False,
        checkpoint_engine=SimpleNamespace(load=torch.load), grid=SimpleNamespace(data_parallel_size=1),
        module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), stage_id=0)
    node_dir = os.path.join(save_dir, f"node{rank}")
    os.makedirs(os.path.join(node_dir, "two"))
    if rank == 0:
        torch.save({"version": 1, "parts": [0, 3, 4], "replicas": 1, "layer_states": True, "reason": None},
                   os.path.join(node_dir, "two", checkpoint.MANIFEST))
        torch.save({"params": {name: {"fp32": None} for name, _ in module.named_parameters()}, "step": None},
                   os.path.join(node_dir, "two", f"{checkpoint.PREFIX}layer_00.pt"))

    def upstream_load(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                      load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return os.path.join(load_dir, tag), {}

    try:
        checkpoint.load_checkpoint(engine, upstream_load, node_dir, tag="two")
        moved = None
    except ValueError as exc:
        moved = str(exc)
    return failure, moved


@pytest.mark.multiprocess
def test_a_load_that_fails_on_one_rank_or_finds_its_manifest_on_one_node_stops_every_rank(tmp_path):
    """Every rank enters the load's agreements alike: whatever a rank's part raised, and wherever
    the manifest is (on node-local directories only rank 0's node has it), every rank stops with
    the error of the rank that failed instead of leaving the others waiting in a gather."""
    from harness import run_ranks
    results = run_ranks(_load_agreement, world_size=2, timeout=60, args=(str(tmp_path), ))
    for failure, moved in results:
        assert failure == ("deepspeed-hetero: load_checkpoint: moving the layers' optimizer state failed on global "
                           "rank 1: TypeError: an unexpected failure"), failure
        assert moved.startswith("deepspeed-hetero: load_checkpoint: moving the layers' optimizer state failed on "
                                "global rank 1: ValueError: deepspeed-hetero: load_checkpoint: "), moved
        assert f"node1/two/{'heterogeneous_states-'}layer_00.pt is missing" in moved, moved


def _recorded(rank, world_size, heterogeneous):
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    with recording() as entries:
        _pipeline(rank, world_size, heterogeneous, zero=1)
    return list(entries)


@pytest.mark.multiprocess
def test_uneven_replicas_issue_the_same_collectives_in_every_group():
    """2 stages x 2 replicas, micro-batches [6, 2] (ZeRO-1): in every process group, each member
    issues the same sequence of collectives (the stage's all-reduces, the pipeline's transfers
    between the two ranks of a replica, the fork's gathers over all ranks). Point-to-point ops pair
    a send with a receive and are left out."""
    from deepspeed.runtime.heterogeneous.measure.collective_log import mismatch_report
    slow_replica = {"emulation": {"speeds": [1.0, 0.5, 1.0, 0.5], "mode": "dilation"}}
    sequences = run_subcases(_recorded, [dict(heterogeneous=slow_replica)], world_size=4, timeout=600)[0]
    groups = {entry.group for sequence in sequences for entry in sequence if len(entry.group) > 1}
    assert (0, 1) in groups and (2, 3) in groups and (0, 1, 2, 3) in groups, groups  # stage groups, the world
    for group in sorted(groups):
        members = [[entry for entry in sequences[rank] if entry.group == group
                    and entry.op not in ("send", "recv", "isend", "irecv")] for rank in group]
        assert members[0], group
        report = mismatch_report(members)
        assert not report, f"group {group}:\n{report}"


_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_TRAINING_STEPS = ("first step", "step after the load")  # the phases of _walked inside a training step


def _walked(rank, world_size, save_dir):
    """2 stages at speeds [1.0, 0.5] fed by the user's iterator: each rank's collectives recorded
    apart at every point outside a training step where the fork issues some (the engine's start,
    save_checkpoint, load_checkpoint) and in the training steps around them."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    heterogeneous = {"emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}, "pipeline": {"layer_cost": "parameters"}}
    phases = {}
    net = PipelineModule(layers=_layers(), num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="heterogeneous")
    with recording() as entries:
        engine = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=_config(heterogeneous))[0]
    phases["start-up"] = list(entries)
    # The controller and its speed check (a gather over every rank) exist before any training step.
    runtime = engine._config.heterogeneous.runtime
    speed_check = None if runtime is None or runtime.limits.speed_check is None else runtime.limits.speed_check.mode
    batches = _users_batches(engine, _data(BATCH * (STEPS + 1)))
    steps = [("first step", lambda: engine.train_batch(data_iter=batches)),
             ("save_checkpoint", lambda: engine.save_checkpoint(save_dir, tag="walk")),
             ("load_checkpoint", lambda: engine.load_checkpoint(save_dir, tag="walk")),
             ("step after the load", lambda: engine.train_batch(data_iter=batches))]
    for phase, call in steps:
        with recording() as entries:
            call()
        phases[phase] = list(entries)
    return {"phases": phases, "speed_check": speed_check}


@pytest.mark.multiprocess
def test_every_rank_of_a_pipeline_reaches_each_collective_outside_a_training_step(tmp_path):
    """The collectives issued outside a training step (the fork's start-up agreements, among them
    the runtime controller's speed check, and its checkpoint agreements) are issued where every rank
    is: in each process group, each member issues the same sequence at each of those points. None
    of the fork's object agreements waits inside a pipeline's training step, which the stages enter
    at different times; the steps' own collectives are compared by
    ``test_uneven_replicas_issue_the_same_collectives_in_every_group``. Point-to-point ops pair a
    send with a receive and are left out."""
    from harness import run_ranks
    from deepspeed.runtime.heterogeneous.measure.collective_log import mismatch_report
    results = run_ranks(_walked, world_size=2, timeout=600, args=(str(tmp_path), ))
    assert [result["speed_check"] for result in results] == ["dilation"] * 2, results
    for phase in results[0]["phases"]:
        sequences = [result["phases"][phase] for result in results]
        agreements = [[entry for entry in sequence if entry.op in ("all_gather_object", "broadcast_object_list")]
                      for sequence in sequences]
        if phase in _TRAINING_STEPS:
            assert agreements == [[], []], f"{phase}: {[[str(entry) for entry in mine] for mine in agreements]}"
            continue
        assert agreements[0] and all(entry.group == (0, 1) for entry in agreements[0]), (phase, agreements)
        groups = {entry.group for sequence in sequences for entry in sequence if len(entry.group) > 1}
        for group in sorted(groups):
            members = [[entry for entry in sequences[rank] if entry.group == group and entry.op not in _POINT_TO_POINT]
                       for rank in group]
            report = mismatch_report(members)
            assert not report, f"{phase}, group {group}:\n{report}"
