# SPDX-License-Identifier: Apache-2.0
"""The start-up's steps: per-rank batch sizes, the memory placement, per-rank offload.

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

from .cluster.agreement import Agreement, largest_per_replica
from .comm import host_shard_plan, overlap
from .comm.status import status_line
from .comm.link_buckets import apply_link_aware_buckets
from .memory.model_state import startup_memory_limits
from .memory.meter import EMULATED, MemoryMeter
from .memory.placement import engine_placement, offloads_per_rank, refuse_unfit_peaks
from .memory.pool import HeterogeneousMemoryPool, ModelStateSpec, memory_capacities
from .memory.zero3_shards import existing_shares
from .memory.partitions import check_shares, shares_differ
from .planning.planner import Plan, plan_micro_batches, time_models_from_scores


def initial_plan(settings, train_batch_size, gas, world_size, zero_stage, devices=None, max_micro_batch=None,
                 allow_per_rank_gas=None):
    """The plan in force until measurements replace the priors (pure: no collectives);
    ``max_micro_batch``: per-rank memory limits (``startup_memory_limits``), or None;
    ``allow_per_rank_gas``: default, ZeRO-0/1 unless the loss counts items (``loss_items`` sums
    the counts at every micro-step, so every rank must run as many)."""
    config = settings.config
    if allow_per_rank_gas is None:
        allow_per_rank_gas = zero_stage <= 1 and config.loss_items is None
    names = [d.name for d in devices] if devices else None
    scores = [1.0] * world_size
    if config.strategy.adapts and devices:
        known = [d.spec_score for d in devices]
        # A device without a datasheet entry scores 0 here; rather than guess, start equal and let
        # the profiling steps measure the real workload.
        if all(score > 0 for score in known):
            scores = known
    return plan_micro_batches(time_models_from_scores(scores), train_batch_size=train_batch_size,
                              gradient_accumulation_steps=gas, strategy=config.load_balancing_strategy,
                              manual=config.micro_batch_sizes, device_names=names,
                              max_micro_batch=max_micro_batch,
                              allow_per_rank_gas=allow_per_rank_gas).with_prior_times()


def provisional_batch(ds_config, state):
    """The batch fields while the config is only parsed (``DeepSpeedConfig.__init__``, before
    ``coordinator.coordinate``): ``train_batch_size`` as given and the even split, which upstream's
    checks accept; the start-up plan replaces them. No plan yet (``state.plan`` is None).

    Requires ``train_batch_size`` (the global batch); ``gradient_accumulation_steps`` defaults to
    1. A ``train_micro_batch_size_per_gpu`` in the config is ignored with a warning: the plan
    decides each rank's micro-batch.
    """
    train_batch = ds_config.train_batch_size
    if train_batch is None:
        from .config.errors import one_line_config_errors
        from .config.settings import HeterogeneousConfigError
        one_line_config_errors()  # every rank raises it: one line from rank 0
        raise HeterogeneousConfigError("invalid DeepSpeed config: heterogeneous_config needs train_batch_size (the "
                                       "global batch); per-rank micro-batch sizes are planned from it")
    gas = ds_config.gradient_accumulation_steps or 1
    if ds_config.train_micro_batch_size_per_gpu is not None:
        logger.warning("train_micro_batch_size_per_gpu is ignored with heterogeneous_config enabled: each rank's "
                       "micro-batch comes from the plan (train_batch_size stays the global batch)")
    state.base_gas = gas
    ds_config.gradient_accumulation_steps = gas
    ds_config.train_micro_batch_size_per_gpu = max(1, int(train_batch) // (gas * int(ds_config.world_size)))


def configure_heterogeneous_batch(ds_config, state):
    """Set ``ds_config``'s batch fields for this rank from the start-up plan (``state`` is
    ``ds_config.heterogeneous``, coordinated: ``coordinator.coordinate``), planned once per
    process and settings."""
    train_batch = ds_config.train_batch_size
    gas = ds_config.gradient_accumulation_steps or 1
    if state.precision is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info(f"deepspeed-hetero precision: {state.precision.dtype} ({state.precision.reason})")
        if state.precision.overridden:
            logger.warning(f"deepspeed-hetero precision: {state.precision.overridden}")
    zero_stage = int(ds_config.zero_optimization_stage or 0)
    state.base_gas = gas
    key = (int(train_batch), int(gas), int(ds_config.world_size), zero_stage)
    if key not in state.startup_plans:  # planned once per process and settings, however many configs
        state.startup_plans[key] = initial_plan(state.settings, train_batch, gas, int(ds_config.world_size),
                                                zero_stage, state.devices)
    plan = state.startup_plans[key]
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
    if plan is None or model is None or not state.settings.config.strategy.adapts:
        return plan
    capacities = memory_capacities(state)
    if capacities is None:
        return plan  # no limit known: what upstream itself would run
    per_micro_step = plan.train_batch_size // state.base_gas
    pool = state.memory_pool
    predicted = [pool.predicted_peak(rank) for rank in range(plan.world_size)] if pool is not None else None
    if predicted is not None and all(p is not None for p in predicted):
        state_bytes = [p.peak_bytes for p in predicted]
    else:
        # The same model the pool predicts with, without the pool's gathered baselines.
        spec = ModelStateSpec.for_engine(ds_config, model, optimizer, emulated_device=_emulated_device(state))
        shares = state.partition_shares
        mine = spec.rank_bytes(ds_config, state.partition_share, max(shares) if shares else None)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = Agreement(f"data-parallel rank {state.dp_rank}").gather_from_every_rank(
                {"dp_rank": state.dp_rank, "state_bytes": mine}, "the predicted bytes at start-up")
            # Model-parallel members of a replica hold different shards: the largest one counts.
            state_bytes = largest_per_replica(((g["dp_rank"], g["state_bytes"]) for g in gathered), plan.world_size)
        else:
            state_bytes = [mine] * plan.world_size
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
    # A model zero.Init partitioned already keeps its cut, which the placement then checks, unless
    # "auto" finds other shares better for it (zero.Init decided before the model existed).
    cut = existing_shares(model) if stage == 3 else None
    recut = cut is not None and setting == "auto" and memory.enabled and world >= 2
    setting = cut or setting
    if not memory.enabled:
        explicit = stage in (1, 2, 3) and world >= 2 and setting not in ("auto", "even")
        return None, check_shares(setting, world) if explicit else None, {}
    pool = HeterogeneousMemoryPool.from_state(state, world)
    offload = state.settings.offload
    # A model zero.Init partitioned is in use already: its slices, which the spec counts, are not baseline.
    baselines = gather_baselines(state, world, counted_bytes=partitioned_bytes(model) if cut is not None else 0)
    # An emulated device (capacity by accounting alone) is not the host, whatever the accelerator.
    spec = ModelStateSpec.for_engine(ds_config, model, optimizer,
                                     emulated_device=state.memory_meter.source == EMULATED)
    communication = state.settings.config.communication
    hosts = state.topology.hosts if state.topology is not None else None
    if stage == 3 and host_shard_plan.expected(communication, ds_config.zero_config, hosts):
        spec = replace(spec, host_shards=True)  # each host's copy of the parameters, cut among its ranks
    if spec.allocations is not None and overlap.expected(communication, ds_config.zero_config, hosts):
        spec = replace(spec, allocations=replace(spec.allocations, overlap_buckets=overlap.DEPTH))

    def placed(zero_partitions, activations=None):
        return engine_placement(pool, spec, zero_partitions, offload.cpu_offload, offload.nvme_offload,
                                baseline_bytes=baselines, activation_bytes=activations)

    def settle():
        """``(auto, note, placement, offloaded)`` for the spec in force."""
        wants_auto = setting == "auto" or recut
        auto, note = auto_shares_with_room(state, ds_config, pool, placed) if wants_auto else ("auto", None)
        return (auto, note, *placed(auto if setting == "auto" else setting))

    auto, note, placement, offloaded = settle()
    if offloaded and spec.allocations is not None and spec.allocations.overlap_buckets:
        # A rank that offloads turns overlap off on every rank (overlap.overlap_decision): placed without
        # the worker's buckets, unless the ranks would then fit without offloading and overlap again.
        counted = spec
        spec = replace(spec, allocations=replace(spec.allocations, overlap_buckets=0))
        without = settle()
        if without[3]:
            auto, note, placement, offloaded = without
        else:
            spec = counted
            auto, note, placement, offloaded = settle()
    if note and state.dp_rank == 0:
        logger.warning(note)
    if recut:
        wanted = placed(auto)
        if shares_differ(cut, wanted[0].partition_shares, world):
            recut_zero3_model(state, model, cut, wanted[0].partition_shares, world)
            placement, offloaded = wanted
    if state.dp_rank == 0:
        cpu_unapplied = offload.cpu_offload and not offloads_per_rank(stage, world)
        nvme_unapplied = offload.nvme_offload and not (stage == 3 and offloads_per_rank(stage, world))
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


def auto_shares_with_room(state, ds_config, pool, placed):
    """``("auto", None)``, or where ``heterogeneous_memory.activation_bytes_per_sample`` estimates the
    activations, the shares ``"auto"`` gives with each rank's room for its speed's part of every
    micro-step kept free (``memory/activation_room.py``) and the line saying what it reserved, which
    the caller logs once from rank 0 for the placement it keeps."""
    from .memory.activation_room import activation_room
    from .memory.partitions import describe_shares
    per_sample = state.settings.memory.activation_bytes
    world = pool.world_size
    if not per_sample or world < 2 or int(ds_config.zero_optimization_stage or 0) < 1:
        return "auto", None
    samples = int(ds_config.train_batch_size) // max(1, int(ds_config.gradient_accumulation_steps))
    activations, fraction = activation_room(lambda a: placed("auto", a)[0], pool.speeds, per_sample, samples)
    shares = None if activations is None else placed("auto", activations)[0].partition_shares
    if shares is None:
        return "auto", (f"deepspeed-hetero memory pool: heterogeneous_memory.activation_bytes_per_sample {per_sample} "
                        "B: the ranks' memory leaves no rank's state room to spare for it; the ZeRO shares follow "
                        "memory and speed alone")
    return list(shares), (f"deepspeed-hetero memory pool: ZeRO shares {describe_shares(shares)} leave each rank room "
                          f"for {fraction:.0%} of its speed's part of the {samples} samples of a micro-step at "
                          f"{per_sample / 2**20:.3g} MiB per sample (heterogeneous_memory.activation_bytes_per_sample)")


def recut_zero3_model(state, model, cut, shares, world):
    """Cut the ZeRO-3 parameters of ``model`` (cut by ``zero.Init`` into ``cut``) into ``shares``, the
    engine's ``"auto"`` for this model, before its optimizer exists: parameter by parameter
    (``uneven_shards.repartition``), exactly, once. Every rank decides it alike from the gathered
    devices and the model; the optimizer compares the slices' digest before its first collective."""
    import time
    from deepspeed.utils import logger
    from .comm.uneven_shards import repartition
    from .memory.partitions import describe_shares
    from .memory.zero3_shards import shard_layout
    started = time.perf_counter()
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    moved, elements = repartition(params, shard_layout(shares, world), world)
    if state.dp_rank == 0:
        before = "equal slices" if cut == "even" else describe_shares(cut)
        after = "equal slices" if shares is None else describe_shares(shares)
        logger.warning(f"deepspeed-hetero: re-cut the ZeRO-3 parameters zero.Init had partitioned into {before} to "
                       f"{after}, the shares heterogeneous_memory.zero_partitions \"auto\" gives this model on these "
                       f"ranks: {moved} parameters ({elements / 1e6:.3g}M elements) in "
                       f"{time.perf_counter() - started:.2f} s")


def partitioned_bytes(model):
    """The bytes of this rank's slices of ``model``'s trainable ZeRO-3 parameters (partitioned by
    ``zero.Init`` before the engine): the spec counts them as the rank's parameters."""
    return sum(int(p.ds_tensor.numel()) * p.ds_tensor.element_size() for p in model.parameters()
               if p.requires_grad and getattr(p, "ds_tensor", None) is not None)


def gather_baselines(state, world, counted_bytes=0):
    """Per data-parallel rank, the bytes in use on its device as the engine starts (``memory_meter``,
    started here and kept as ``state.memory_meter``), less ``counted_bytes`` that the model state
    counts already (what is not in use, an emulated device's, is 0), gathered so that every rank
    places alike; a replica counts its fullest member."""
    import torch.distributed as dist
    state.memory_meter = rank_memory_meter(state)
    mine = max(0, state.memory_meter.start() - int(counted_bytes))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine] * world
    gathered = Agreement(f"data-parallel rank {state.dp_rank}").gather_from_every_rank(
        (state.dp_rank, mine), "the memory in use as the engine starts")
    return largest_per_replica(((r, b or 0) for r, b in gathered), world, default=0)


def rank_memory_meter(state):
    """This rank's ``MemoryMeter``: an emulated capacity enforced by accounting alone
    (``emulation.memory_gb`` without a memory cgroup) is an empty device with no peak to read;
    otherwise the source that limits the rank (``measures_capacity`` only where the capacity is
    what limits it)."""
    meter = MemoryMeter(source=EMULATED if _emulated_device(state) else None)
    # The emulation cgroup's limit is memory_gb plus a host allowance: its peak is reported, and the
    # kernel enforces the limit, but it is not measured against the emulated capacity.
    meter.measures_capacity = meter.measures_capacity and not _memory_emulated(state)
    return meter


def _memory_emulated(state):
    emulation = state.settings.config.emulation
    return emulation is not None and bool(emulation.memory_gb)


def _emulated_device(state):
    """Whether this rank's capacity is emulated by accounting alone (``emulation.memory_gb``
    without a memory cgroup): a device apart from the host, even on the CPU accelerator."""
    joined = state.memory_cgroup is not None and state.memory_cgroup.cgroup is not None
    return _memory_emulated(state) and not joined


def check_nvme_ranks(nvme_ranks, dp_rank):
    """Every rank learns whether the ranks placed on NVMe can build the async-io op (it needs
    ``libaio``: Debian's ``libaio-dev``) before any of them tries: one agreement over the world
    (``agreement.gather_from_every_rank``), so a rank that cannot ends the job on every rank with
    an error naming it instead of failing alone while its peers wait in a collective."""
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


def configure_link_buckets(state, param_dict, user_zero):
    """The coordinator's step (``coordinator._settle_config``): apply the rule to ``param_dict`` from the state's
    settings, topology and adaptive chunking's sizes; log the choice once (data-parallel rank 0),
    and say why not when the user asked for it (``true``) and it cannot apply. Returns the sizes
    written (None when none)."""
    from deepspeed.utils import logger
    setting = state.settings.config.communication.link_aware_buckets
    if state.settings.config.communication.mode == "low_communication" and setting == "auto":
        setting = False  # the buckets never cross the link: each host reduces its own
    sizes, note = apply_link_aware_buckets(param_dict, setting, state.enabled, state.topology, user_zero,
                                           state.chunk_sizes)
    if note and setting is True:
        logger.warning(f"heterogeneous_config.communication.link_aware_buckets: upstream's bucket sizes kept: {note}")
    if state.dp_rank == 0 and state.topology is not None and state.topology.num_hosts > 1:
        logger.info(f"deepspeed-hetero: Communication Optimization: "
                    f"{status_line(state.settings, state.topology, param_dict, sizes)}")
    return sizes or None


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
