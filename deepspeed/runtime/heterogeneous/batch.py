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

from .devices import DeviceDescription, describe_local_device, emulated_memory_bytes, local_device_index
from .planner import plan_micro_batches, time_models_from_scores


def data_parallel_rank(mpu=None, mesh_device=None):
    """This process's data-parallel rank (its global rank without model parallelism)."""
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank"):
        return mpu.get_data_parallel_rank()
    if mesh_device is not None:
        return dist.get_rank(group=mesh_device.get_group(mesh_dim="data_parallel"))
    return dist.get_rank() if dist.is_initialized() else 0


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
            or _emulated_memory(settings) is not None or config.mixed_precision_support != "config")


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
    is known: the CPU accelerator reports host RAM, which its ranks share, so on CPU a limit comes
    only from an emulated capacity."""
    devices = state.devices
    if not devices:
        return None
    if _emulated_memory(state.settings) is not None:
        return [d.memory_bytes for d in devices]
    capacities = [None if d.accelerator == "cpu" else d.memory_bytes for d in devices]
    return capacities if any(c is not None for c in capacities) else None


def initial_plan(settings, train_batch_size, gas, world_size, zero_stage, devices=None):
    """The plan in force until measurements replace the priors (pure: no collectives)."""
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
                              allow_per_rank_gas=zero_stage <= 1)


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
