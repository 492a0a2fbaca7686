# SPDX-License-Identifier: Apache-2.0
"""Per-rank batch sizes at ``DeepSpeedConfig`` time.

Upstream asserts ``train_batch_size == micro_batch * gas * world_size`` on every rank. With
heterogeneous training the global batch stays ``train_batch_size`` and rank i runs ``mbs_i``
samples per micro-step, so the invariant becomes ``train_batch_size == sum_i mbs_i * gas_i``.
This module resolves the start-up plan (before any step was measured, from the strategy, the
manual sizes or the devices' prior scores) and writes this rank's values into the config, where
every upstream reader of ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
finds them.
"""

from dataclasses import replace

from deepspeed import comm as dist
from deepspeed.utils import logger

from .agreement import Agreement
from .devices import DeviceDescription, describe_local_device, emulated_memory_bytes, local_device_index
from .memory import config_model_state_bytes, startup_memory_limits
from .planner import Plan, plan_micro_batches, time_models_from_scores


def data_parallel_rank(mpu=None, mesh_device=None, world_size=None, sequence_parallel_size=None):
    """This process's data-parallel rank: which of the ``world_size`` replicas that
    ``DeepSpeedConfig`` counts it belongs to. Derived here once (``state.dp_rank``); the plan, the
    loss weight and the training loader all use it.

    It follows the grouping the engine reduces gradients over
    (``groups._get_sequence_data_parallel_group``, divided by the replica count): an mpu's own
    data-parallel rank; with a sequence-parallel mpu (Ulysses, which has no data-parallel calls) the
    sequence-parallel groups are consecutive ranks of the sequence-data-parallel group, so the
    replica is that rank divided by the sequence-parallel size (its members split the same samples'
    sequences, as model-parallel members split the model); with a device mesh, the rank in its
    "data_parallel" dimension; otherwise the global rank.

    Args:
        world_size: the data-parallel world size the config counts; checked against, when given.
        sequence_parallel_size: the config's top-level ``sequence_parallel_size`` (used only to
            refuse it without an mpu or a mesh, which leaves the replicas unknown).
    """
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank"):
        rank = mpu.get_data_parallel_rank()
    elif mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        rank = mpu.get_sequence_data_parallel_rank() // mpu.get_sequence_parallel_world_size()
    elif mesh_device is not None:
        rank = dist.get_rank(group=mesh_device.get_group(mesh_dim="data_parallel"))
    elif sequence_parallel_size not in (None, 1):
        raise ValueError(f"heterogeneous_config with sequence_parallel_size {sequence_parallel_size} needs the "
                         "sequence-parallel groups: pass the mpu (deepspeed.initialize(mpu=...)) or give "
                         "data_parallel_size too (a device mesh), so that each rank's replica is known")
    else:
        rank = dist.get_rank() if dist.is_initialized() else 0
    rank = int(rank)
    if world_size is not None and not 0 <= rank < int(world_size):
        raise ValueError(f"deepspeed-hetero: data-parallel rank {rank} is out of range for the data-parallel world "
                         f"size {world_size} the config counts; the mpu / mesh and the config disagree")
    return rank


def gather_devices(dp_rank, world_size, memory_bytes=None):
    """Every data-parallel rank's DeviceDescription, in data-parallel rank order; ``memory_bytes``
    replaces this rank's real capacity (emulated clusters).

    All processes take part, so that the model-parallel members of a replica agree: a replica is
    described by its slowest member's device, with its smallest memory.
    """
    # Unknown devices are not benchmarked here: the profiling steps measure the real workload.
    mine = describe_local_device(local_rank=local_device_index(), memory_bytes=memory_bytes, measure=False).to_dict()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [DeviceDescription.from_dict(mine)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, mine))
    devices = []
    for rank in range(world_size):
        members = [DeviceDescription.from_dict(d) for r, d in gathered if r == rank]
        slowest = min(members, key=lambda d: (d.spec_score, d.rank))
        devices.append(replace(slowest, memory_bytes=min(d.memory_bytes for d in members)))
    return devices


def _needs_devices(settings):
    config = settings.config
    return (config.load_balancing_strategy == "compute_aware" or isinstance(config.micro_batch_sizes, dict)
            or _emulated_memory(settings) is not None or config.mixed_precision_support != "config"
            or settings.memory.enabled)  # the memory pool places by each rank's capacity


def _emulated_memory(settings):
    emulation = settings.config.emulation
    return emulation.memory_gb if emulation is not None and emulation.memory_gb else None


def gather_local_devices(settings, dp_rank, world_size):
    """``gather_devices`` when a decision needs the devices (None otherwise), with this rank's
    emulated memory in place of its real capacity."""
    if not _needs_devices(settings):
        return None
    return gather_devices(dp_rank, world_size, emulated_memory_bytes(settings.config.emulation, dp_rank))


def memory_capacities(state):
    """Per data-parallel rank, the device memory plans must fit in (bytes), or None where no limit
    is known: the CPU accelerator reports host RAM, which its ranks share, so there a limit comes
    only from an emulated capacity."""
    devices = state.devices
    if not devices:
        return None
    if _emulated_memory(state.settings) is not None:
        return [d.memory_bytes for d in devices]
    capacities = [None if d.shared_host_memory else d.memory_bytes for d in devices]
    return capacities if any(c is not None for c in capacities) else None


def initial_plan(settings, train_batch_size, gas, world_size, zero_stage, devices=None, max_micro_batch=None,
                 allow_per_rank_gas=None):
    """The plan in force until measurements replace the priors (pure: no collectives);
    ``max_micro_batch``: per-rank memory limits (``startup_memory_limits``), or None;
    ``allow_per_rank_gas``: default, ZeRO-0/1."""
    config = settings.config
    names = [d.name for d in devices] if devices else None
    scores = [1.0] * world_size
    if config.load_balancing_strategy == "compute_aware" and devices:
        known = [d.spec_score for d in devices]
        # A device without a datasheet entry scores 0 here; rather than guess, start equal and let
        # the profiling steps measure the real workload.
        if all(score > 0 for score in known):
            scores = known
    return plan_micro_batches(time_models_from_scores(scores), train_batch_size=train_batch_size,
                              gradient_accumulation_steps=gas, strategy=config.load_balancing_strategy,
                              manual=config.micro_batch_sizes, device_names=names,
                              max_micro_batch=max_micro_batch,
                              allow_per_rank_gas=zero_stage <= 1 if allow_per_rank_gas is None else allow_per_rank_gas
                              ).with_prior_times()


def configure_heterogeneous_batch(ds_config, state):
    """Set ``ds_config``'s batch fields for this rank from the start-up plan (``state`` is
    ``ds_config.heterogeneous``).

    Requires ``train_batch_size`` (the global batch); ``gradient_accumulation_steps`` defaults to
    1. A ``train_micro_batch_size_per_gpu`` in the config is ignored with a warning: the plan
    decides each rank's micro-batch.
    """
    train_batch = ds_config.train_batch_size
    if train_batch is None:
        raise ValueError("invalid DeepSpeed config: heterogeneous_config needs train_batch_size (the global "
                         "batch); per-rank micro-batch sizes are planned from it")
    gas = ds_config.gradient_accumulation_steps or 1
    if ds_config.train_micro_batch_size_per_gpu is not None:
        logger.warning("train_micro_batch_size_per_gpu is ignored with heterogeneous_config enabled: each rank's "
                       "micro-batch comes from the plan (train_batch_size stays the global batch)")
    if state.precision is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(f"deepspeed-hetero precision: {state.precision.dtype} ({state.precision.reason})")
        if state.precision.overridden:
            logger.warning(f"deepspeed-hetero precision: {state.precision.overridden}")
    zero_stage = int(ds_config.zero_optimization_stage or 0)
    state.base_gas = gas
    plan = initial_plan(state.settings, train_batch, gas, int(ds_config.world_size), zero_stage, state.devices)
    apply_plan(ds_config, plan)
    return plan


def apply_plan(ds_config, plan):
    """Make ``plan`` the one in force for this rank (at start-up, or at a step boundary): upstream
    reads the batch fields, the fork reads ``ds_config.heterogeneous.plan``."""
    state = ds_config.heterogeneous
    state.plan = plan
    ds_config.train_batch_size = plan.train_batch_size
    ds_config.train_micro_batch_size_per_gpu = plan.micro_batch_sizes[state.dp_rank]
    ds_config.gradient_accumulation_steps = plan.gradient_accumulation_steps[state.dp_rank]


def cap_startup_plan(ds_config, model, optimizer=None):
    """Keep the first step within every rank's memory before anything was measured; returns the
    plan in force. Runs as the engine starts (``HeterogeneousState.engine_starting``), when the
    model is known and nothing has read the batch fields yet.

    A rank under a limit (a smaller GPU, a job scheduler's memory cgroup) may not hold the equal
    split the user sized the batch for, nor a datasheet prior's share (an H100 next to a V100:
    8:1), and its first step would be killed before any activation was measured. Until the first
    profiling step has measured them, each rank with a known limit runs at most its room's
    proportion of the micro-step (``memory.startup_memory_limits``; the room is its capacity at
    ``hbm_utilization_threshold`` less its predicted peak without activations, the memory pool's
    when it placed this engine). The plan before the cap stays the reference profiling judges
    against (``state.reference_plan``); it runs again only where the measured limits allow it.
    Every rank reaches the same decision: the pool's predictions are the same on every rank;
    without a pool, the model-state bytes are gathered (one collective, whenever capacities are
    known, which every rank knows alike).
    """
    state = ds_config.heterogeneous
    plan = state.plan
    state.reference_plan = plan
    if plan is None or model is None or state.settings.config.load_balancing_strategy != "compute_aware":
        return plan
    capacities = memory_capacities(state)
    if capacities is None:
        return plan  # no limit known: what upstream itself would run
    per_micro_step = plan.train_batch_size // state.base_gas
    pool = state.memory_pool
    predicted = [pool.predicted_peak(rank) for rank in range(plan.world_size)] if pool is not None else None
    if predicted is not None and all(p is not None for p in predicted):
        state_bytes = [p.peak_bytes for p in predicted]
    elif dist.is_initialized() and dist.get_world_size() > 1:
        mine = config_model_state_bytes(ds_config, model, optimizer)
        gathered = Agreement(f"data-parallel rank {state.dp_rank}").gather_from_every_rank(
            {"dp_rank": state.dp_rank, "state_bytes": mine}, "the model-state bytes at start-up")
        # Model-parallel members of a replica hold different shards: the largest one counts.
        state_bytes = [max(g["state_bytes"] for g in gathered if g["dp_rank"] == rank)
                       for rank in range(plan.world_size)]
    else:
        state_bytes = [config_model_state_bytes(ds_config, model, optimizer)] * plan.world_size
    names = state.device_names or [f"rank {rank}" for rank in range(plan.world_size)]
    limits = startup_memory_limits(capacities, state_bytes, state.settings.memory.hbm_utilization_threshold,
                                   per_micro_step, [f"data-parallel rank {r} ({names[r]})" for r in range(len(names))],
                                   unlimited_bytes=_memory_without_limit(state))
    if all(limit is None or size <= limit for size, limit in zip(plan.micro_batch_sizes, limits)):
        return plan
    # Equal gas: any loop feeds this first step, whatever counts its micro-steps.
    capped = initial_plan(state.settings, plan.train_batch_size, state.base_gas, plan.world_size,
                          int(ds_config.zero_optimization_stage or 0), state.devices, max_micro_batch=limits,
                          allow_per_rank_gas=False)
    shown = ["-" if limit is None else limit for limit in limits]
    capped = Plan(**{**capped.to_dict(), "notes": list(capped.notes) + [
        f"start-up memory limits until the first step measures activations (samples per micro-step, per rank): "
        f"{shown}"]})
    apply_plan(ds_config, capped)
    return capped


def _memory_without_limit(state):
    """Per data-parallel rank, the memory a rank without a known limit may use (its device's; on a
    host whose ranks share its RAM, the RAM over those ranks), for the start-up estimate only."""
    devices = state.devices
    if not devices:
        return None
    per_host = {}
    for device in devices:
        per_host[device.host] = per_host.get(device.host, 0) + 1
    return [d.memory_bytes / per_host[d.host] if d.shared_host_memory else d.memory_bytes for d in devices]
