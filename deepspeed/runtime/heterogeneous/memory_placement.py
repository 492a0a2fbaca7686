# SPDX-License-Identifier: Apache-2.0
"""The memory pool's two users (``memory_pool.py``): the engine's placement as it starts
(``place_engine_state``, then ``apply_rank_offload`` for the ranks it offloads) and the env report's
placement for a ds_config (``config_placement_lines``, ``parse_parameter_count`` for
``--model-parameters``). Both decide through ``engine_placement``, so the report shows what the
engine would do."""

import math

from .memory_meter import EMULATED
from .memory_pool import NVME, HeterogeneousMemoryPool, ModelStateSpec, known_speeds
from .memory_spec import zero3_offload_ratio
from .partitions import check_shares


def place_engine_state(state, ds_config, model, optimizer=None):
    """``(pool or None, partition shares, offload)`` as the engine starts
    (``HeterogeneousState.engine_starting``).

    With ``heterogeneous_memory.enabled`` the pool decides the shares and which ranks offload their
    optimizer state, and is returned to be kept on the state; otherwise only explicit shares apply.
    Every rank decides alike from what every rank has (the config, the gathered devices, the
    model); the ZeRO optimizer still compares the layout's digest. Ranks that do not fit offload
    their optimizer state when ``heterogeneous_offload`` allows it (``apply_rank_offload``): to the
    host (``cpu_offload``), all of it in ZeRO-1/2, the fewest whole sub-groups in ZeRO-3; in ZeRO-3
    all of it to NVMe (``nvme_offload``) where the node's host budget
    (``heterogeneous_memory.cpu_memory_limit``) cannot take it, or where only NVMe is allowed. The
    placement is not strict: what cannot be placed is logged, and the memory checks that follow
    (and the device) have the last word.

    ``offload`` maps each offloading data-parallel rank to ``(device, offload_optimizer.ratio)``:
    "cpu" or "nvme", and 1.0 for all of its optimizer state."""
    from deepspeed.utils import logger
    memory = state.settings.memory
    setting = memory.zero_partitions
    stage = int(ds_config.zero_optimization_stage or 0)
    world = int(ds_config.world_size)
    if not memory.enabled:
        explicit = stage in (1, 2) and world >= 2 and setting not in ("auto", "even")
        return None, check_shares(setting, world) if explicit else None, {}
    pool = HeterogeneousMemoryPool.from_state(state, world)
    offload = state.settings.offload
    baselines = gather_baselines(state, world)
    # An emulated device (capacity by accounting alone) is not the host, whatever the accelerator.
    spec = ModelStateSpec.for_engine(ds_config, model, optimizer,
                                     emulated_device=state.memory_meter.source == EMULATED)
    placement, offloaded = engine_placement(pool, spec, setting, offload.cpu_offload, offload.nvme_offload,
                                            baseline_bytes=baselines)
    if state.dp_rank == 0:
        cpu_unapplied = offload.cpu_offload and not _offloads_per_rank(stage, world)
        nvme_unapplied = offload.nvme_offload and not (stage == 3 and _offloads_per_rank(stage, world))
        unapplied = [key for key, wanted in (("nvme_offload", nvme_unapplied), ("cpu_offload", cpu_unapplied))
                     if wanted]
        if unapplied:
            logger.warning(f"deepspeed-hetero memory pool: zero_optimization.heterogeneous_offload."
                           f"{' and '.join(unapplied)} is not applied per rank here (per-rank offload drives ZeRO "
                           "stages 1-3 to the host and ZeRO-3 to NVMe, on 2+ ranks); set "
                           "zero_optimization.offload_optimizer to offload on every rank")
        for problem in placement.problems:
            logger.warning(f"deepspeed-hetero memory pool: {problem}")
    refuse_unfit_peaks(pool, placement, offload.cpu_offload or offload.nvme_offload)
    return pool, placement.partition_shares, offloaded


def refuse_unfit_peaks(pool, placement, offload_allowed):
    """Stop every rank, before DeepSpeed allocates, when a rank's predicted peak (``memory_peak``,
    activations not yet counted) passes its budget whatever the pool chose: the profiling steps
    would find no plan either, and under a physical limit the rank would be killed. Every rank
    holds the same placement, so every rank raises the same error."""
    from .memory_pool import MemoryPlacementError
    unfit = [r for r in placement.ranks if r.predicted_peak_bytes is not None and not r.fits]
    if unfit:
        problems = [pool.rank_problem(r, pool.model_state, offload_allowed) for r in unfit]
        raise MemoryPlacementError("deepspeed-hetero memory pool: no placement fits: " + "; ".join(problems))


def gather_baselines(state, world):
    """Per data-parallel rank, the bytes in use on its device as the engine starts (``memory_meter``,
    started here and kept as ``state.memory_meter``), gathered so that every rank places alike; a
    replica counts its fullest member."""
    import torch.distributed as dist
    state.memory_meter = rank_memory_meter(state)
    mine = state.memory_meter.start()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine] * world
    from .agreement import Agreement
    gathered = Agreement(f"data-parallel rank {state.dp_rank}").gather_from_every_rank(
        (state.dp_rank, mine), "the memory in use as the engine starts")
    return [max((b or 0 for r, b in gathered if r == rank), default=0) for rank in range(world)]


def rank_memory_meter(state):
    """This rank's ``MemoryMeter``: an emulated capacity enforced by accounting alone
    (``emulation.memory_gb`` without a memory cgroup) is an empty device with no peak to read;
    otherwise the source that limits the rank (``measures_capacity`` only where the capacity is
    what limits it)."""
    from . import emulation
    from .memory_meter import MemoryMeter
    emulated = state.settings.config.emulation is not None and bool(state.settings.config.emulation.memory_gb)
    joined = emulation._memory_cgroup is not None and emulation._memory_cgroup.cgroup is not None
    meter = MemoryMeter(source=EMULATED if emulated and not joined else None)
    # The emulation cgroup's limit is memory_gb plus a host allowance: its peak is reported, and the
    # kernel enforces the limit, but it is not measured against the emulated capacity.
    meter.measures_capacity = meter.measures_capacity and not emulated
    return meter


def engine_placement(pool, spec, zero_partitions, cpu_offload, nvme_offload=False, baseline_bytes=None):
    """``(placement, {offloading rank: (device, offload_optimizer.ratio)})``: the pool's placement of
    ``spec`` as an engine applies it.

    Per-rank offload drives ZeRO stages 1-3 on 2+ ranks to the host (``cpu_offload``) and ZeRO-3 to
    NVMe (``nvme_offload``; upstream's ZeRO-1/2 have no NVMe offload), only when the config does not
    offload every rank already. ZeRO-3 offloads whole sub-groups to the host
    (``ModelStateSpec.sub_groups``; all of them where the optimizer cannot be DeepSpeedCPUAdam), all
    of its optimizer state to NVMe. Once a ZeRO-1/2 rank offloads, the shares are even: upstream's
    offloaded ZeRO-1/2 path keeps equal slices (``partitions.zero_partition_layout``), so explicit
    uneven shares are refused."""
    applies = _offloads_per_rank(spec.zero_stage, pool.world_size) and spec.optimizer_device is None
    per_rank = cpu_offload and applies
    nvme = nvme_offload and applies and spec.zero_stage == 3
    placement = pool.place(spec, zero_partitions=zero_partitions, cpu_offload=per_rank, nvme_offload=nvme,
                           strict=False, baseline_bytes=baseline_bytes)
    offloaded = tuple(placement.offloaded_ranks) if per_rank or nvme else ()
    if spec.zero_stage == 3:
        return placement, {rank: _zero3_offload(placement.ranks[rank], spec) for rank in offloaded}
    if offloaded and zero_partitions not in ("auto", "even"):
        raise ValueError(f"heterogeneous_memory.zero_partitions {list(zero_partitions)} gives the ranks uneven "
                         f"shares, but data-parallel rank(s) {list(offloaded)} must offload their optimizer state "
                         "to fit (zero_optimization.heterogeneous_offload.cpu_offload), and upstream's offloaded "
                         "ZeRO-1/2 path keeps equal slices. Use zero_partitions \"auto\" (shares from memory, even "
                         "once a rank offloads) or \"even\", or turn cpu_offload off")
    if offloaded and placement.partition_shares is not None:
        placement = pool.place(spec, zero_partitions="even", cpu_offload=True, nvme_offload=False, strict=False,
                               baseline_bytes=baseline_bytes)
        offloaded = tuple(placement.offloaded_ranks)
    return placement, {rank: ("cpu", 1.0) for rank in offloaded}


def _zero3_offload(rank, spec):
    """``(device, offload_optimizer.ratio)`` for what the pool chose for a ZeRO-3 rank: NVMe takes
    all of it; the host its number of sub-groups where known, else the fraction itself (upstream
    rounds it to sub-groups, keeping ``int((1 - ratio) * n)`` of them on the device)."""
    if rank.optimizer_location == NVME:
        return "nvme", 1.0
    if rank.offload_fraction >= 1.0 or rank.offload_sub_groups is None:
        return "cpu", min(1.0, rank.offload_fraction)
    return "cpu", zero3_offload_ratio(rank.offload_sub_groups, len(spec.sub_groups))


def _offloads_per_rank(stage, world):
    """Where per-rank offload is applied: ZeRO stages 1-3 on 2+ data-parallel ranks."""
    return stage in (1, 2, 3) and world >= 2


def apply_rank_offload(ds_config, offload, dp_rank, optimizer=None, nvme_path=None):
    """Move the optimizer state of the ranks the pool offloads off the device; ``offload`` maps
    each offloading data-parallel rank to ``(device, ratio)`` (``engine_placement``), ``nvme_path``
    is ``heterogeneous_offload.nvme_path``.

    The one edit of upstream's validated config after start-up (the model, and so what fits, is
    known only as the engine starts): ``zero_optimization.offload_optimizer`` on the offloading
    ranks (ZeRO-3: with the rank's ratio over sub-groups, or NVMe), and in ZeRO-1/2
    ``contiguous_gradients`` on every rank, which upstream forces on an offloading rank and which
    chooses between bucketed and per-tensor gradient reductions: anything that shapes a collective
    stays the same on all ranks. Every rank refuses alike what would fail on the offloading ranks
    alone (and leave the others waiting in a collective): a client optimizer other than
    DeepSpeedCPUAdam while ``zero_force_ds_cpu_optimizer`` holds, and NVMe on a rank where the
    async-io op cannot build (``check_nvme_ranks``, one agreement on every rank)."""
    if not offload:
        return
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum
    ranks = sorted(offload)
    key = "zero_optimization.heterogeneous_offload"
    if (optimizer is not None and not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion))
            and ds_config.zero_force_ds_cpu_optimizer):
        # Upstream checks what a client callable builds only on the offloading rank, once built.
        what = (type(optimizer).__name__ if isinstance(optimizer, torch.optim.Optimizer) else
                "a callable, whose optimizer cannot be checked on every rank before it is built")
        raise ValueError(f"heterogeneous_memory offloads the optimizer state of data-parallel rank(s) {ranks} "
                         f"({key}), and the client's optimizer ({what}) is not DeepSpeedCPUAdam or "
                         "DeepSpeedCPULion, which ZeRO-Offload requires unless zero_force_ds_cpu_optimizer is false. "
                         "Pass a deepspeed.ops.adam.DeepSpeedCPUAdam instance, set an optimizer in the config, set "
                         "\"zero_force_ds_cpu_optimizer\": false, or give the ranks room "
                         f"({key}.cpu_offload and nvme_offload: false)")
    nvme_ranks = [rank for rank, (device, _) in sorted(offload.items()) if device == "nvme"]
    if nvme_ranks:
        check_nvme_ranks(nvme_ranks, dp_rank)
    stage = int(ds_config.zero_optimization_stage or 0)
    zero = ds_config.zero_config
    if stage in (1, 2):
        zero.contiguous_gradients = True
    if dp_rank in offload:
        device, ratio = offload[dp_rank]
        if device == "nvme":
            zero.offload_optimizer = DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.nvme,
                                                                         nvme_path=nvme_path)
        else:
            zero.offload_optimizer = DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu,
                                                                         ratio=float(ratio) if stage == 3 else 1.0)


def check_nvme_ranks(nvme_ranks, dp_rank):
    """Every rank learns whether the ranks placed on NVMe can build the async-io op (it needs
    ``libaio``: Debian's ``libaio-dev``) before any of them tries: one agreement over the world
    (``agreement.gather_from_every_rank``), so a rank that cannot ends the job on every rank with
    an error naming it instead of failing alone while its peers wait in a collective."""
    from .agreement import Agreement
    able = True
    if dp_rank in nvme_ranks:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        able = bool(AsyncIOBuilder().is_compatible(verbose=False))
    flags = Agreement(f"data-parallel rank {dp_rank}").gather_from_every_rank(able, "whether the async-io op builds")
    unable = [rank for rank, flag in enumerate(flags) if not flag]
    if unable:
        raise RuntimeError(f"heterogeneous_memory places the optimizer state of data-parallel rank(s) {nvme_ranks} on "
                           f"NVMe (zero_optimization.heterogeneous_offload.nvme_offload), but global rank(s) {unable} "
                           "cannot build DeepSpeed's async-io op, which needs libaio (Debian/Ubuntu: apt-get install "
                           "libaio-dev; see `ds_report`). Install it there, raise heterogeneous_memory.cpu_memory_limit "
                           "so the host takes the state, or turn nvme_offload off")


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
    # Rows whose capacity is emulated are devices apart from the host; a CPU row without emulation
    # has no capacity of its own, so its placement checks nothing either way.
    spec = ModelStateSpec.for_config_dict(param_dict, num_parameters, half, world=len(rows),
                                          emulated_device=any(emulated for _, emulated, _ in rows))
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
        engine_placement(pool, spec, memory.zero_partitions if auto_allowed else "even", settings.offload.cpu_offload,
                         settings.offload.nvme_offload)
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
