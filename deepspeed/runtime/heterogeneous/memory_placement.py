# SPDX-License-Identifier: Apache-2.0
"""The memory pool's two users (``memory_pool.py``): the engine's placement as it starts
(``place_engine_state``, then ``apply_rank_offload`` for the ranks it offloads) and the env report's
placement for a ds_config (``config_placement_lines``, ``parse_parameter_count`` for
``--model-parameters``). Both decide through ``engine_placement``, so the report shows what the
engine would do."""

import math

from .memory_pool import HeterogeneousMemoryPool, ModelStateSpec, known_speeds
from .partitions import check_shares


def place_engine_state(state, ds_config, model, optimizer=None):
    """``(pool or None, partition shares, offloaded ranks)`` as the engine starts
    (``HeterogeneousState.engine_starting``).

    With ``heterogeneous_memory.enabled`` the pool decides the shares and which ranks offload their
    optimizer state, and is returned to be kept on the state; otherwise only explicit shares apply.
    Every rank decides alike from what every rank has (the config, the gathered devices, the
    model); the ZeRO optimizer still compares the layout's digest. ZeRO-1/2 ranks that do not fit
    offload to the host when ``heterogeneous_offload.cpu_offload`` allows it (``apply_rank_offload``);
    per-rank NVMe and ZeRO-3 offload are not applied, so those placements are decided without
    offload. The placement is not strict: what cannot be placed is logged, and the memory checks
    that follow (and the device) have the last word."""
    from deepspeed.utils import logger
    memory = state.settings.memory
    setting = memory.zero_partitions
    stage = int(ds_config.zero_optimization_stage or 0)
    world = int(ds_config.world_size)
    if not memory.enabled:
        explicit = stage in (1, 2) and world >= 2 and setting not in ("auto", "even")
        return None, check_shares(setting, world) if explicit else None, ()
    pool = HeterogeneousMemoryPool.from_state(state, world)
    offload = state.settings.offload
    placement, offloaded = engine_placement(pool, ModelStateSpec.for_engine(ds_config, model, optimizer), setting,
                                            offload.cpu_offload)
    if state.dp_rank == 0:
        cpu_unapplied = offload.cpu_offload and not _offloads_per_rank(stage, world)
        unapplied = [key for key, wanted in (("nvme_offload", offload.nvme_offload), ("cpu_offload", cpu_unapplied))
                     if wanted]
        if unapplied:
            logger.warning(f"deepspeed-hetero memory pool: zero_optimization.heterogeneous_offload."
                           f"{' and '.join(unapplied)} is not applied per rank here (per-rank offload drives ZeRO "
                           "stage 1-2 to the host on 2+ ranks); set zero_optimization.offload_optimizer to offload "
                           "on every rank")
        for problem in placement.problems:
            logger.warning(f"deepspeed-hetero memory pool: {problem}")
    return pool, placement.partition_shares, offloaded


def engine_placement(pool, spec, zero_partitions, cpu_offload):
    """``(placement, offloaded ranks)``: the pool's placement of ``spec`` as an engine applies it.

    Per-rank offload drives ZeRO-1/2 on 2+ ranks to the host (``cpu_offload``), and only when the
    config does not offload every rank already; NVMe and ZeRO-3 placements are decided without
    offload. Once a rank offloads, the shares are even: upstream's offloaded ZeRO-1/2 path keeps
    equal slices (``partitions.zero_partition_layout``), so explicit uneven shares are refused."""
    per_rank = cpu_offload and _offloads_per_rank(spec.zero_stage, pool.world_size) and spec.optimizer_device is None
    placement = pool.place(spec, zero_partitions=zero_partitions, cpu_offload=per_rank, nvme_offload=False,
                           strict=False)
    offloaded = tuple(placement.offloaded_ranks) if per_rank else ()
    if offloaded and zero_partitions not in ("auto", "even"):
        raise ValueError(f"heterogeneous_memory.zero_partitions {list(zero_partitions)} gives the ranks uneven "
                         f"shares, but data-parallel rank(s) {list(offloaded)} must offload their optimizer state "
                         "to fit (zero_optimization.heterogeneous_offload.cpu_offload), and upstream's offloaded "
                         "ZeRO-1/2 path keeps equal slices. Use zero_partitions \"auto\" (shares from memory, even "
                         "once a rank offloads) or \"even\", or turn cpu_offload off")
    if offloaded and placement.partition_shares is not None:
        placement = pool.place(spec, zero_partitions="even", cpu_offload=True, nvme_offload=False, strict=False)
        offloaded = tuple(placement.offloaded_ranks)
    return placement, offloaded


def _offloads_per_rank(stage, world):
    """Where per-rank offload is applied: ZeRO-1/2 on 2+ data-parallel ranks."""
    return stage in (1, 2) and world >= 2


def apply_rank_offload(ds_config, offloaded_ranks, dp_rank):
    """Move the optimizer state of the ranks the pool offloads (``offloaded_ranks``) to the host.

    The one edit of upstream's validated config after start-up (the model, and so what fits, is
    known only as the engine starts): ``zero_optimization.offload_optimizer`` on the offloading
    ranks, and ``contiguous_gradients`` on every rank, which upstream forces on an offloading rank
    and which chooses between bucketed and per-tensor gradient reductions: anything that shapes a
    collective stays the same on all ranks. Refuses the adaptive loss scaler, which the offloaded
    ZeRO-1/2 path cannot feed."""
    if not offloaded_ranks:
        return
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum
    fp16 = ds_config.float16_config
    if fp16.enabled and fp16.auto_scale_threshold is not None:
        raise ValueError(f"heterogeneous_memory offloads the optimizer state of data-parallel rank(s) "
                         f"{list(offloaded_ranks)} to the host (zero_optimization.heterogeneous_offload.cpu_offload), "
                         f"but fp16.auto_scale_threshold ({fp16.auto_scale_threshold}) selects the adaptive loss "
                         "scaler, which ZeRO stage 1-2 cannot feed from an offloaded optimizer. Use bf16 or fp32 "
                         "(heterogeneous_config.mixed_precision_support), remove fp16.auto_scale_threshold, or give "
                         "the ranks room (heterogeneous_offload.cpu_offload: false)")
    zero = ds_config.zero_config
    zero.contiguous_gradients = True
    if dp_rank in offloaded_ranks:
        zero.offload_optimizer = DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu)


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
    title = f"Memory Placement ({num_parameters:,} parameters, {'fp16/bf16' if half else 'fp32'}):"
    try:
        engine_placement(pool, spec, memory.zero_partitions if auto_allowed else "even", settings.offload.cpu_offload)
    except ValueError as exc:
        return [title, f"  refused: {exc}"]
    return [title] + ["  " + line for line in str(pool.report()).splitlines()]


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
