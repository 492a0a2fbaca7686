# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous pipeline parallelism (docs/pipeline.md): a ``PipelineModule`` whose stages are
sized to their devices, and data-parallel replicas of it that take uneven shares of the batch.

``PipelineModule(..., partition_method="heterogeneous")`` builds no layer at construction: the
stages' speeds and memory are in the DeepSpeed config, which the module does not see
(``pipe-heterogeneous.patch`` defers it). As the engine starts
(``HeterogeneousState.engine_starting``), ``build_stages``

1. learns every global rank's speed (its device's spec score relative to the fastest, times its
   ``emulation.speeds`` entry on an emulated cluster; one gather over all processes, the same on
   every rank) and, when known, its memory;
2. weighs each layer by its forward and backward time, measured on every rank on the first
   micro-batch of ``training_data`` (``measure_layer_costs``; the median share over ranks), or by
   its trainable parameters (``pipeline.layer_cost: "parameters"``, or no map-style data);
3. cuts the layers so that the slowest stage's ``cost / speed`` is least (``planning/stages.py``),
   or takes ``heterogeneous_config.pipeline.stage_layers``;
4. builds this stage's layers, and fills a ``model_parameters`` list that was taken from the module
   before the build (then empty);
5. with the ``compute_aware`` strategy, gives each replica a micro-batch in proportion to its
   pipeline's speed: its slowest stage's ``cost / speed`` per sample.

The exactness of uneven replicas needs nothing pipeline-specific: the last stage's loss goes
through ``engine.backward``, which weights it by the replica's share of the global batch, and the
other stages receive gradients already weighted. The partition stays for the whole run.
"""

from dataclasses import dataclass

from deepspeed import comm as dist
from deepspeed.utils import logger

from ..cluster.agreement import Agreement
from ..measure.devices import describe_local_device, local_device_index
from ..planning.stages import (ADAM_BYTES_PER_PARAMETER, StagePartition, given_partition, manual_partition,
                              partition_stages, relative_rank_speeds, replica_sample_times,
                              stage_speeds)

PARTITION_METHOD = "heterogeneous"


def defer_partition(module):
    """``PipelineModule._partition_layers`` for ``partition_method="heterogeneous"``: nothing is
    built until the engine starts (``build_stages``)."""
    module._heterogeneous_deferred = True
    module.parts = None


def is_deferred(model):
    return bool(getattr(model, "_heterogeneous_deferred", False))


@dataclass(frozen=True)
class PipelineLayout:
    """What the plan table and the profiler show of a heterogeneous pipeline."""

    partition: StagePartition
    upstream: StagePartition
    """Upstream's ``parameters`` partition of the same layers, under the same speeds."""
    stage_speeds: tuple
    rank_speeds: tuple
    coords: tuple
    """Per global rank, (stage, replica)."""
    layer_costs: tuple
    cost_unit: str
    """What ``layer_costs`` are: measured seconds, or trainable parameters."""
    replica_times: tuple
    """Per replica, its time per sample (its slowest stage's cost / speed)."""

    @property
    def stages(self):
        return len(self.stage_speeds)

    @property
    def replicas(self):
        return len(self.replica_times)

    def table(self):
        lines = [f"[deepspeed-hetero] pipeline: {self.stages} stage(s) x {self.replicas} replica(s) (the plan's ranks "
                 f"are the replicas), partition {self.partition.method} (layer cost: {self.cost_unit}; a stage's "
                 f"speed: its slowest replica's)"]
        lines.append("stage  layers  range      cost        speed  cost/speed   "
                     "(parameters partition: layers, cost/speed)")
        for s in range(self.stages):
            a, b = self.partition.parts[s], self.partition.parts[s + 1]
            ua, ub = self.upstream.parts[s], self.upstream.parts[s + 1]
            lines.append(f"{s:5d}  {b - a:6d}  {f'{a}-{b - 1}':9s}  {sum(self.layer_costs[a:b]):10.4g}  "
                         f"{self.stage_speeds[s]:5.3g}  {self.partition.stage_times[s]:11.4g}  "
                         f"({ub - ua}, {self.upstream.stage_times[s]:.4g})")
        ranks = {}
        for g, (s, r) in enumerate(self.coords):
            ranks.setdefault(r, []).append(f"{g}@{self.rank_speeds[g]:g}")
        for r in range(self.replicas):
            lines.append(f"replica {r}: global ranks (stage order) {', '.join(ranks.get(r, []))}; time/sample "
                         f"{self.replica_times[r]:.4g}")
        gain = self.upstream.bottleneck / self.partition.bottleneck if self.partition.bottleneck else 1.0
        lines.append(f"slowest stage {self.partition.bottleneck:.4g} per sample vs {self.upstream.bottleneck:.4g} "
                     f"with upstream's parameters partition (predicted {gain:.2f}x)")
        return "\n".join(lines)


def _rank_speeds_and_memory(state):
    """Per global rank: its relative speed, its memory in bytes (or None) and its local rank; the
    same lists on every rank."""
    emulation = state.settings.config.emulation
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = describe_local_device(local_rank=local_device_index(), measure=False)
    emulated = emulation.speeds[rank] if emulation is not None and emulation.speeds else 1.0
    memory = None
    if emulation is not None and emulation.memory_gb:
        memory = float(emulation.memory_gb[rank]) * 2**30
    mine = {"rank": rank, "score": float(device.spec_score), "speed": float(emulated), "memory": memory,
            "local": int(local_device_index())}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = Agreement(f"global rank {rank}").gather_from_every_rank(mine, "every stage's device")
    else:
        gathered = [mine]
    gathered = sorted(gathered, key=lambda entry: entry["rank"])
    speeds = relative_rank_speeds([entry["score"] for entry in gathered], [entry["speed"] for entry in gathered])
    return speeds, [entry["memory"] for entry in gathered], [entry["local"] for entry in gathered]


def is_pipeline(model):
    from deepspeed.runtime.pipe.module import PipelineModule
    return isinstance(model, PipelineModule)


PROBE_WARMUP_SECONDS = 0.3
"""Before any layer is timed, the first layer runs for at least this long (at least 10 times): a
process's first backward passes start its thread pools, which on a CPU made the first layers of
the probe read up to 3x slower than the same layers later."""

PROBE_REPEATS = 5
"""Each layer's forward and backward is timed this many times on the probe, after one untimed
run; the least counts (a burst of another process's work lengthens some runs, never shortens one)."""


def _probe_layer(spec, device):
    """A callable for layer ``spec`` on ``device`` and how to undo what the probe did to it."""
    import torch
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
    if isinstance(spec, torch.nn.Module):
        before = next((p.device for p in spec.parameters()), None)
        spec.to(device)

        def restore():  # the caller's module as it was: where it was, no gradient from the probe
            for parameter in spec.parameters():
                parameter.grad = None
            if before is not None:
                spec.to(before)

        return spec, restore
    if isinstance(spec, LayerSpec):
        module = spec.build().to(device)
        if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
            return (lambda x: spec.forward_fn(module, x)), (lambda: None)
        return module, (lambda: None)
    return spec, (lambda: None)


def _tensors(value):
    import torch
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _detached(value, device, requires_grad, dtype=None):
    """``value``'s tensors detached onto ``device``; floating ones in ``dtype`` (the layer's: the
    layers are probed before the engine casts them, e.g. to bf16, and the data may be cast already)."""
    import torch
    if torch.is_tensor(value):
        value = value.detach().to(device)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.requires_grad_(requires_grad and value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v, device, requires_grad, dtype) for v in value)
    return value


def _floating_dtype(layer):
    import torch
    if isinstance(layer, torch.nn.Module):
        return next((p.dtype for p in layer.parameters() if p.is_floating_point()), None)
    return None


def measure_layer_costs(model, training_data, micro_batch_size):
    """Per layer, the least of ``PROBE_REPEATS`` timings (after one untimed run) of its forward and
    backward on this rank's device, fed the previous layer's output for the first
    ``micro_batch_size`` samples of ``training_data`` (the pipeline's convention: a sample is
    ``(inputs, labels)``). Layers are built one at a time (as upstream's ``parameters`` method
    does); the random number generator is left as it was. Raises on a layer the probe cannot run."""
    import time

    import torch
    from torch.utils.data import default_collate
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device = accelerator.device_name(model.local_rank)
    count = min(int(micro_batch_size), len(training_data))
    batch = default_collate([training_data[i] for i in range(count)])
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    costs = []
    with torch.random.fork_rng(devices=[]):
        _warm_up(model._layer_specs[0], x, device)
        for spec in model._layer_specs:
            layer, restore = _probe_layer(spec, device)
            dtype = _floating_dtype(layer)
            best, out = float("inf"), None
            for repeat in range(PROBE_REPEATS + 1):
                inputs = _detached(x, device, requires_grad=True, dtype=dtype)
                accelerator.synchronize()
                began = time.perf_counter()
                out = layer(inputs)
                grads = [t for t in _tensors(out) if t.requires_grad]
                if grads:
                    torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
                accelerator.synchronize()
                if repeat:  # the first run warms up: allocations, kernels, caches
                    best = min(best, time.perf_counter() - began)
            costs.append(best)
            x = _detached(out, device, requires_grad=False)
            restore()
            del layer
    return costs


def _warm_up(spec, x, device):
    import time

    import torch
    layer, restore = _probe_layer(spec, device)
    dtype = _floating_dtype(layer)
    began, runs = time.perf_counter(), 0
    while runs < 10 or time.perf_counter() - began < PROBE_WARMUP_SECONDS:
        out = layer(_detached(x, device, requires_grad=True, dtype=dtype))
        grads = [t for t in _tensors(out) if t.requires_grad]
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
        runs += 1
        if runs >= 1000:
            break
    restore()


def _agreed_costs(state, model, training_data, counts, local_ranks):
    """The layer costs every rank uses, and what they are (for the table): measured on every rank
    and combined as the median over ranks of each layer's share of its rank's total (ranks that
    run at other speeds agree on the shares), scaled to the median total; else parameter counts.

    The ranks of one host probe in turns (local rank 0 on every host, then local rank 1, ...; a
    barrier between turns): ranks probing at once on shared cores would time each other's
    contention, which changes as they finish, and read it as some layers' cost."""
    config = state.settings.config.pipeline
    parameters = [float(c) for c in counts]
    if config.layer_cost == "parameters":
        return parameters, "trainable parameters"
    if training_data is None or not hasattr(training_data, "__getitem__") or not hasattr(training_data, "__len__"):
        return parameters, "trainable parameters (no map-style training_data to time the layers on)"
    rank = dist.get_rank() if dist.is_initialized() else 0
    many = dist.is_initialized() and dist.get_world_size() > 1
    agreement = Agreement(f"global rank {rank}")
    mine = None
    for turn in range(max(local_ranks) + 1):
        if local_ranks[rank] == turn:
            try:
                mine = {"rank": rank,
                        "costs": measure_layer_costs(model, training_data, state.plan.micro_batch_sizes[0])}
            except Exception as error:  # a layer the probe cannot run: every rank learns it at the gather
                mine = {"rank": rank, "error": f"{type(error).__name__}: {error}"}
        if many:
            agreement.barrier(f"the layer probe's turn {turn}")
    if many:
        gathered = agreement.gather_from_every_rank(mine, "every rank's layer timings")
    else:
        gathered = [mine]
    failed = [entry for entry in gathered if "error" in entry]
    if failed:
        raise ValueError(f"deepspeed-hetero: timing the PipelineModule's layers on the first micro-batch of "
                         f"training_data failed on global rank {failed[0]['rank']} ({failed[0]['error']}); set "
                         "heterogeneous_config.pipeline.layer_cost to \"parameters\" to weigh layers by their "
                         "parameters instead")
    shares, totals = [], []
    for entry in gathered:
        total = sum(entry["costs"]) or 1.0
        totals.append(total)
        shares.append([c / total for c in entry["costs"]])
    scale = _median(totals)
    costs = [_median([share[layer] for share in shares]) * scale for layer in range(len(parameters))]
    return costs, f"forward + backward seconds, timed on {len(gathered)} rank(s)"


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def build_stages(state, model, model_parameters=None, training_data=None):
    """Partition and build a deferred ``PipelineModule`` (see the module docstring); returns its
    ``PipelineLayout``. A module partitioned by one of upstream's methods keeps its stages: the
    layout then describes them (and the replicas' plan still follows their speeds)."""
    from deepspeed.runtime import utils as ds_utils

    deferred = is_deferred(model)
    topo = model._topo
    world = topo.world_size()
    coords = tuple((topo.get_coord(g).pipe, topo.get_coord(g).data) for g in range(world))
    stages, replicas = model.num_stages, topo.get_dim("data")
    rank_speeds, rank_memory, local_ranks = _rank_speeds_and_memory(state)
    speeds = stage_speeds(rank_speeds, [c[0] for c in coords], stages)
    counts = model._count_layer_params()  # builds each layer once, as upstream's 'parameters' method does
    costs, cost_unit = _agreed_costs(state, model, training_data, counts, local_ranks) if deferred else (
        [float(c) for c in counts], "trainable parameters")
    capacities = None
    if any(m is not None for m in rank_memory):
        capacities = [None] * stages
        threshold = state.settings.memory.hbm_utilization_threshold
        for memory, (stage, _) in zip(rank_memory, coords):
            if memory is not None:
                room = memory * threshold
                capacities[stage] = room if capacities[stage] is None else min(capacities[stage], room)
    stage_layers = state.settings.config.pipeline.stage_layers
    if not deferred:
        if "partition" in state.settings.config.pipeline.model_fields_set:
            raise ValueError("heterogeneous_config.pipeline.partition needs PipelineModule(partition_method="
                             f"'{PARTITION_METHOD}'): this module was partitioned by upstream's method at construction")
        if stage_layers:
            raise ValueError("heterogeneous_config.pipeline.stage_layers needs PipelineModule(partition_method="
                             f"'{PARTITION_METHOD}'): this module was partitioned by upstream's method at construction")
        partition = given_partition([int(p) for p in model.parts], costs, speeds, "upstream")
    elif stage_layers:
        partition = manual_partition(stage_layers, costs, speeds)
    elif state.settings.config.pipeline.partition == "parameters":
        partition = given_partition([int(p) for p in ds_utils.partition_balanced(weights=counts, num_parts=stages)],
                                    costs, speeds, "parameters")
    elif state.settings.config.pipeline.partition == "uniform":
        partition = given_partition([int(p) for p in ds_utils.partition_uniform(len(counts), stages)], costs, speeds,
                                    "uniform")
    else:
        layer_bytes = [ADAM_BYTES_PER_PARAMETER * c for c in counts] if capacities else None
        partition = partition_stages(costs, speeds, layer_bytes, capacities)
    upstream = given_partition([int(p) for p in ds_utils.partition_balanced(weights=counts, num_parts=stages)], costs,
                               speeds, "parameters")
    if deferred:
        _build(model, partition)
    if deferred and isinstance(model_parameters, list) and not model_parameters:
        # Taken from the module before it was built: the list the caller passed is the one the
        # engine reads, so it is filled in place.
        model_parameters.extend(p for p in model.parameters() if p.requires_grad)
    elif deferred and isinstance(model_parameters, list) and model_parameters and \
            isinstance(model_parameters[0], dict) and not any(group.get("params") for group in model_parameters):
        raise ValueError("partition_method 'heterogeneous' builds the PipelineModule's layers as the engine starts, so "
                         "parameter groups taken from it before deepspeed.initialize are empty: pass "
                         "model_parameters=model.parameters() (or leave it out), or use one of upstream's partition "
                         "methods to build the groups before deepspeed.initialize")
    layout = PipelineLayout(partition, upstream, tuple(speeds), tuple(rank_speeds), coords, tuple(costs), cost_unit,
                            tuple(replica_sample_times(partition, costs, rank_speeds, coords, replicas)))
    return layout


def _build(model, partition):
    from deepspeed.accelerator import get_accelerator
    model.parts = list(partition.parts)
    model._heterogeneous_deferred = False
    stage = model.stage_id
    model._set_bounds(start=model.parts[stage], stop=model.parts[stage + 1])
    model._build()
    model.to(get_accelerator().device_name(model.local_rank))
    model.tied_comms = model._index_tied_modules()
    model._synchronize_tied_weights()


def replica_plan(state, layout):
    """The start-up plan of pipeline replicas for a strategy that adapts (``compute_aware``): its plan
    for each replica's pipeline speed (the same gas everywhere). None for other strategies."""
    config = state.settings.config
    if not config.strategy.adapts or layout.replicas < 2:
        return None
    from ..planning.planner import TimeModel, plan_micro_batches
    models = [TimeModel(0.0, t) for t in layout.replica_times]
    return plan_micro_batches(models, train_batch_size=state.plan.train_batch_size,
                              gradient_accumulation_steps=state.base_gas or 1,
                              strategy=config.load_balancing_strategy).with_prior_times()


def check_pipeline_settings(state):
    """Refuse what the fork does not drive with a pipeline, naming the setting. The pipeline engine
    fixes each replica's micro-batch size and count when it starts, so the plan cannot change
    during the run: profiling steps are skipped (a note says so when they were asked for) and
    dynamic rebalancing is refused."""
    config = state.settings.config
    if config.scheduler.dynamic_rebalancing:
        raise ValueError("heterogeneous_config.scheduler.dynamic_rebalancing is not supported with a PipelineModule: "
                         "the pipeline engine fixes each replica's micro-batches when it starts, so the replicas keep "
                         "their start-up plan (set dynamic_rebalancing to false)")
    if config.loss_items is not None:
        raise ValueError("heterogeneous_config.loss_items is not supported with a PipelineModule: the loss is computed "
                         "on the last stage, which is not given the inputs whose items it would count (remove "
                         "loss_items)")
    if config.profile_steps:
        if "profile_steps" in config.model_fields_set and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(f"deepspeed-hetero: heterogeneous_config.profile_steps {config.profile_steps} is not used "
                           "with a PipelineModule: the stages and the replicas' micro-batches come from the devices' speeds "
                           "(emulation.speeds, device scores) and stay for the run")
        config.profile_steps = 0
