# SPDX-License-Identifier: Apache-2.0
"""The memory pool's two users (``memory_pool.py``): the engine's placement as it starts
(``place_engine_state``) and the env report's placement for a ds_config (``config_placement_lines``,
``parse_parameter_count`` for ``--model-parameters``)."""

import math

from .memory_pool import HeterogeneousMemoryPool, ModelStateSpec, known_speeds
from .partitions import check_shares


def place_engine_state(state, ds_config, model, optimizer=None):
    """``(pool or None, partition shares)`` as the engine starts (``HeterogeneousState.engine_starting``).

    With ``heterogeneous_memory.enabled`` the pool decides the shares and is returned to be kept
    on the state; otherwise only explicit shares apply. Every rank decides alike from what every
    rank has (the config, the gathered devices, the model); the ZeRO optimizer still compares the
    layout's digest. Per-rank offload is decided by ``place`` but applied by no engine yet, so the
    engine's placement is decided without it, and not strictly: what cannot be placed is logged,
    and the memory checks that follow (and the device) have the last word, as before the pool."""
    from deepspeed.utils import logger
    memory = state.settings.memory
    setting = memory.zero_partitions
    stage = int(ds_config.zero_optimization_stage or 0)
    world = int(ds_config.world_size)
    if not memory.enabled:
        explicit = stage in (1, 2) and world >= 2 and setting not in ("auto", "even")
        return None, check_shares(setting, world) if explicit else None
    pool = HeterogeneousMemoryPool.from_state(state, world)
    # No engine applies per-rank offload yet: shares chosen on the assumption that a rank offloads
    # would leave it with state its device cannot hold. Decide without offload; say so once.
    offload = state.settings.offload
    placement = pool.place(ModelStateSpec.for_engine(ds_config, model, optimizer), zero_partitions=setting,
                           cpu_offload=False, nvme_offload=False, strict=False)
    if state.dp_rank == 0:
        if offload.cpu_offload or offload.nvme_offload:
            logger.warning("deepspeed-hetero memory pool: zero_optimization.heterogeneous_offload is not applied "
                           "per rank yet; the placement keeps every rank's state on its device (set "
                           "zero_optimization.offload_optimizer to offload on every rank)")
        for problem in placement.problems:
            logger.warning(f"deepspeed-hetero memory pool: {problem}")
    return pool, placement.partition_shares


def config_placement_lines(param_dict, settings, rows, num_parameters=None):
    """The env report's placement section for a ds_config on its rows (``(DeviceDescription,
    memory emulated?, speed emulated?)`` per rank, one node); ``num_parameters`` None: a line
    saying the model size is needed."""
    if num_parameters is None:
        return ["Memory Placement: unknown: the config gives no model size; add --model-parameters N"]
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from .precision import choose_precision_for_config
    devices = [device for device, _, _ in rows]
    mode = settings.config.mixed_precision_support if settings.enabled else "config"
    decided = dict(param_dict)
    choose_precision_for_config(mode, devices, decided)
    half = get_float16_config(decided).enabled or get_bfloat16_config(decided).enabled
    spec = ModelStateSpec.for_config_dict(param_dict, num_parameters, half)
    memory = settings.memory
    # As the runtime counts them (batch.memory_capacities): an emulated capacity, else the device's
    # own; the CPU accelerator's shared host RAM is no rank's limit.
    capacities = [d.memory_bytes if emulated or not d.shared_host_memory else None for d, emulated, _ in rows]
    pool = HeterogeneousMemoryPool(capacities, cpu_memory_limit=memory.cpu_memory_limit_bytes,
                                   hbm_utilization_threshold=memory.hbm_utilization_threshold,
                                   hosts=[0] * len(rows), speeds=known_speeds(devices),
                                   device_names=[d.name for d in devices])
    auto_allowed = memory.enabled or memory.zero_partitions != "auto"
    pool.place(spec, zero_partitions=memory.zero_partitions if auto_allowed else "even",
               cpu_offload=settings.offload.cpu_offload, nvme_offload=settings.offload.nvme_offload, strict=False)
    return [f"Memory Placement ({num_parameters:,} parameters, {'fp16/bf16' if half else 'fp32'}):"
            ] + ["  " + line for line in str(pool.report()).splitlines()]


def parse_parameter_count(text):
    """'7e9', '350M', '1.3B', '125k' or digits -> an int; ValueError naming what is allowed."""
    units = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    value = str(text).strip()
    suffix = value[-1:].upper() if value[-1:].isalpha() and value[-1:].upper() in units else ""
    try:
        count = float(value[:-1] if suffix else value) * units[suffix]
    except ValueError:
        count = -1
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"--model-parameters {text!r} is not a parameter count; write e.g. 125000000, 1.3e9, "
                         "350M or 7B")
    return int(count)
