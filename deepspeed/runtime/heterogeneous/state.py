# SPDX-License-Identifier: Apache-2.0
"""The fork's state for one ``DeepSpeedConfig``: its one declared home.

``config-heterogeneous-blocks.patch`` creates it as ``DeepSpeedConfig.heterogeneous`` (always
present; ``enabled`` is False when the fork is off) and every other part of the fork reads it
from there: the engine hooks (``engine._config.heterogeneous``), the runtime controller, the
profiler, the autotuner's experiments.

Life cycle (docs/architecture.md, "Start-up"):

1. ``HeterogeneousState.from_config`` runs in ``DeepSpeedConfig.__init__``: it parses the fork's
   blocks and records this process's data-parallel rank; no collective. ``configure`` then gives
   the batch fields provisional values (the even split).
2. ``coordinate`` (``coordinator.py``) runs once per config, as the engine starts
   (``engine_starting``) or as ``zero.Init`` starts: the settings agreement, the device gather and
   the topology probe (once per process and setting), then the precision, link-aware bucket sizes
   and ZeRO-3 settings settled in a copy of the parsed dict, which upstream parses again, and the
   start-up plan's batch fields (``configure``).
3. ``engine_starting`` goes on with the memory placement and per-rank offload
   (``startup.place_engine_state``, ``startup.apply_rank_offload``) and the first step's memory cap.
4. The engine creates the runtime controller on every rank as it starts, before any loader
   (``runtime``); plans change through ``startup.apply_plan`` at step boundaries.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from deepspeed.utils import logger

from .config.errors import one_line_config_errors
from .config.settings import HeterogeneousConfigError, HeterogeneousSettings, load_heterogeneous_settings
from .measure.devices import DeviceDescription
from .planning.planner import Plan
from .planning.precision import PrecisionChoice
from .cluster.topology import Topology


@dataclass
class HeterogeneousState:
    """What the fork knows and decided for this process (one per ``DeepSpeedConfig``)."""

    settings: HeterogeneousSettings
    """The fork's parsed blocks (heterogeneous_config, heterogeneous_memory, heterogeneous_offload)."""
    param_dict: Optional[dict] = field(default=None, repr=False)
    """The dict upstream parsed the config from (a shallow copy of the user's); the coordinator
    settles a copy of it."""
    coordinated: bool = False
    """Whether ``coordinate`` has run for this config (the batch fields are the plan's, not
    provisional)."""
    dp_rank: int = 0
    """This process's data-parallel rank, derived once from the mpu / mesh at config time (no
    collective: the mpu's, the mesh group's or the global rank)."""
    emulation_rank: Optional[int] = None
    """This process's entry in the emulation's lists: its global rank with pipeline parallelism
    (each process is a device), else None (its data-parallel rank)."""
    pipeline: Optional[object] = field(default=None, repr=False)
    """The ``pipeline.build.PipelineLayout`` of a heterogeneous PipelineModule (None otherwise)."""
    loading_pipeline_parts: Optional[list] = None
    """While a pipeline checkpoint of another cut loads (``pipeline/checkpoint.py``), the saved cut,
    which the fork's record check then accepts: its layers' optimizer states move after the load."""
    devices: Optional[List[DeviceDescription]] = None
    """Every data-parallel rank's device, in rank order (None when no decision needs them)."""
    precision: Optional[PrecisionChoice] = None
    """The precision mixed_precision_support chose (None: the config's own blocks decide)."""
    base_gas: Optional[int] = None
    """The configured gradient accumulation; a plan may raise one rank's own (ZeRO-0/1 memory caps)."""
    plan: Optional[Plan] = None
    """The plan in force (per-rank micro-batches and gas); None when the fork is off."""
    reference_plan: Optional[Plan] = None
    """The start-up plan before the first step's memory cap (``startup.cap_startup_plan``): what
    profiling keeps within the noise and runs again as the switch's reference, where the measured
    memory limits allow it."""
    weight_override: Optional[float] = None
    """This micro-step's loss weight when a re-split forward was given ``num_items_in_batch`` (the
    caller normalised the loss by its count of the fed items: ``runtime.micro_step_begin``); None:
    the plan's. A loss over returned outputs needs none: the exchange rescales its gradient."""
    runtime: Optional[object] = field(default=None, repr=False)
    """The engine's ``HeterogeneousRuntime``, created on every rank as the engine starts."""
    comm_session: Optional[object] = field(default=None, repr=False)
    """The engine's ``comm/session.CommunicationSession`` (its reducer, overlap worker, process groups
    and hooks), opened once the optimizer is built and closed by ``engine.destroy()``."""
    low_communication: Optional[object] = field(default=None, repr=False)
    """``comm/low_communication.LowCommunication`` in ``communication.mode: "low_communication"``
    (each host trains a replica; the hosts meet every ``sync_every`` steps); None: exact training."""
    user_load_universal: Optional[bool] = None
    """The config's ``checkpoint.load_universal``, kept as the first ``load_checkpoint`` starts: a
    load re-partitioned onto this world (``elastic/resize.py``) turns upstream's flag on for its
    own duration only."""
    elastic_load: Optional[dict] = field(default=None, repr=False)
    """While a re-partitioned load runs: what was saved and where its universal form is."""
    chunk_sizes: Optional[dict] = None
    """The ZeRO bucket and prefetch sizes adaptive chunking wrote into the config (elements)."""
    topology: Optional[Topology] = None
    """Which data-parallel ranks share a host and the measured links between host leaders
    (``topology.discover_topology``, as the config is coordinated); None until then."""
    partition_shares: Optional[tuple] = None
    """Each data-parallel rank's share of the ZeRO-1/2 partitioned state (None: equal slices)."""
    init_shares: Optional[tuple] = None
    """``zero_partitions: "auto"``: the ZeRO-3 shares ``zero.Init`` cuts a model by before it exists,
    from the gathered devices (``pool.init_prior_shares``, as the config is coordinated); None: equal
    slices. The engine revisits them once it knows the model (``startup.place_engine_state``)."""
    memory_meter: Optional[object] = field(default=None, repr=False)
    """This rank's ``MemoryMeter``, started as the engine starts (``startup.gather_baselines``)."""
    memory_cgroup: Optional[object] = field(default=None, repr=False)
    """The emulation's ``MemoryLimitCgroup`` this process joined as the engine started (None: no
    emulated memory, or enforced by accounting alone)."""
    memory_pool: Optional[object] = field(default=None, repr=False)
    """The ``HeterogeneousMemoryPool`` that placed this engine's state (``memory_pool.placement``;
    None unless heterogeneous_memory.enabled); the profiler and reports read it."""
    rank_offload: tuple = ()
    """Per data-parallel rank, where the pool put its ZeRO optimizer state and how much of it:
    ``(device, offload_optimizer.ratio)``, device None (kept on the device), "cpu" or "nvme"
    (``zero_optimization.heterogeneous_offload``); the same on every rank; empty when no rank
    offloads. ``offloaded_ranks``, ``nvme_ranks`` and ``offload_ratios`` read it."""
    autotuning_window: Optional[object] = field(default=None, repr=False)
    """The autotuning metric window's progress (``autotuning_window``), also
    with the fork off; None until the first step of an autotuning experiment."""
    startup_plans: dict = field(default_factory=dict, repr=False)
    """The start-up plans made from this process's cluster facts, by (train_batch_size, gas, world
    size, ZeRO stage): a second config of the same settings coordinated on this process
    (``zero.Init``'s, then the engine's) takes its plan from here instead of planning again."""
    link_bucket_sizes: Optional[dict] = None
    """The ZeRO bucket sizes the slowest inter-host link chose (``link_buckets.py``; already the
    smaller of it and adaptive chunking's), in elements; None when the rule did not apply."""

    def __getstate__(self):
        # Upstream pickles the whole config where it hands it to another process (the decoupled
        # checkpoint writer, spawned as the engine starts): the runtime controller and the
        # communication session hold the engine, which does not pickle and means nothing there.
        return {**self.__dict__, "runtime": None, "low_communication": None, "comm_session": None}

    @property
    def enabled(self):
        return self.settings.enabled

    @property
    def emulated_rank(self):
        """This process's index in ``emulation.speeds`` / ``memory_gb``."""
        return self.dp_rank if self.emulation_rank is None else self.emulation_rank

    @property
    def loss_weight(self):
        """w_i = W * n_i / train_batch_size for this rank; 1.0 when the fork is off.

        Every upstream reducer averages gradients over ranks; weighting rank i's loss by w_i turns
        that average into the mean over the global batch, whatever each rank's share n_i is."""
        if self.plan is None:
            return 1.0
        weight = self.plan.loss_weights[self.dp_rank] if self.weight_override is None else self.weight_override
        if self.low_communication is not None:  # the mean over the host's samples, not the world's
            weight *= self.low_communication.loss_scale(self.plan, self.dp_rank)
        return weight

    @property
    def partition_share(self):
        """This rank's share of the ZeRO-1/2 partitioned state; None: upstream's 1/N."""
        return None if self.partition_shares is None else self.partition_shares[self.dp_rank]

    @property
    def offloaded_ranks(self):
        """The data-parallel ranks whose optimizer state (ZeRO-3: some of its sub-groups) is off the
        device, on the host or NVMe."""
        return tuple(rank for rank, (device, _) in enumerate(self.rank_offload) if device)

    @property
    def nvme_ranks(self):
        """The data-parallel ranks whose ZeRO-3 optimizer state is on NVMe (all of it)."""
        return tuple(rank for rank, (device, _) in enumerate(self.rank_offload) if device == "nvme")

    @property
    def offload_ratios(self):
        """Per data-parallel rank, its ``offload_optimizer.ratio`` (0: none; 1: all of its optimizer
        state; ZeRO-3 between: the last sub-groups); empty when no rank offloads."""
        return tuple(ratio for _, ratio in self.rank_offload)

    @property
    def per_rank_zero_state(self):
        """Whether ZeRO-1/2 state differs per rank (uneven shares or per-rank offload): then every
        rank keeps the ZeRO optimizer, since upstream's BF16_Optimizer (ZeRO-1 + bf16) drives
        neither, and one rank on another optimizer would issue other collectives."""
        return self.partition_shares is not None or bool(self.offloaded_ranks)

    def zero3_partitioning(self):
        """A context in which ``deepspeed.zero.Init`` partitions ZeRO-3 parameters with this run's
        shares (the engine builds its ZeRO-3 optimizer in it); parameters partitioned before keep
        theirs."""
        from .memory import zero3_shards
        return zero3_shards.engine_partitioning(self.partition_shares)

    @property
    def device_names(self):
        return [d.name for d in self.devices] if self.devices else None

    @classmethod
    def from_config(cls, param_dict, world_size, mpu=None, mesh_device=None):
        """Parse the fork's blocks of ``param_dict`` (a shallow copy of the user's config, which is
        left unmodified) and record this process's place: no collective, nothing gathered
        (``coordinator.coordinate`` does that, as the engine or ``zero.Init`` starts). A seed-style
        workload "scheduler" is moved out of the LR scheduler's key."""
        from .cluster.ranks import data_parallel_rank
        try:
            settings = load_heterogeneous_settings(param_dict, world_size=world_size,
                                                   process_count=_pipeline_process_count(mpu, world_size))
        except HeterogeneousConfigError:
            one_line_config_errors()
            raise
        for note in settings.notes:
            logger.warning(note)
        state = cls(settings)
        if not settings.enabled:
            return state
        one_line_config_errors()  # every error of a job with the fork on seen once (config/errors.py)
        state.param_dict = param_dict
        state.dp_rank = data_parallel_rank(mpu, mesh_device, world_size, param_dict.get("sequence_parallel_size"))
        if _pipeline_process_count(mpu, world_size) is not None:
            from deepspeed import comm as dist
            state.emulation_rank = dist.get_rank()
        return state

    def coordinate(self, ds_config):
        """The fork's start-up for ``ds_config`` (whose state this is), on every rank: see
        ``coordinator.coordinate``. Once; nothing when the fork is off."""
        from .coordinator import coordinate
        coordinate(ds_config)

    def engine_starting(self, ds_config, engine, model=None, optimizer=None, model_parameters=None):
        """The engine is about to be built from ``ds_config`` (``HeterogeneousEngineMixin.__init__``):
        coordinate the config first (``coordinate``: the start-up collectives, the settled config, the
        start-up plan), then put an emulated rank under its memory cgroup, build a PipelineModule whose partition was
        deferred to now (``pipeline.build_stages``) with its replicas' plan, and keep the start-up
        plan within memory now that the model is known (``startup.cap_startup_plan``). Nothing when
        the fork is off, except refusing a deferred PipelineModule, which only the fork can build."""
        from .comm.low_communication import start as start_low_communication
        from .pipeline.build import PARTITION_METHOD, is_deferred, is_pipeline
        if not self.enabled:
            start_low_communication(self, ds_config, engine, model, False)  # clears an earlier engine's groups
            if is_deferred(model):
                raise ValueError(f"PipelineModule(partition_method='{PARTITION_METHOD}') needs heterogeneous_config."
                                 "enabled: true in the DeepSpeed config (its stages are sized from the devices the "
                                 "fork describes); or use one of upstream's methods ('parameters', 'uniform', "
                                 "'type:...')")
            return
        self.coordinate(ds_config)
        from .emulation.emulator import start_memory_limit
        # Before the engine allocates.
        self.memory_cgroup = start_memory_limit(self.settings.config.emulation, self.emulated_rank)
        self.low_communication = start_low_communication(self, ds_config, engine, model, is_pipeline(model))
        if is_pipeline(model):
            from .pipeline.build import build_stages, check_pipeline_settings, replica_plan
            from .startup import apply_plan
            check_pipeline_settings(self)
            self.pipeline = build_stages(self, model, model_parameters, getattr(engine, "training_data", None))
            plan = replica_plan(self, self.pipeline)
            if plan is not None:
                apply_plan(ds_config, plan)
        if model is not None:
            from .startup import cap_startup_plan
            from .startup import apply_rank_offload, place_engine_state
            from .memory.partitions import describe_shares
            self.memory_pool, self.partition_shares, offload = place_engine_state(self, ds_config, model, optimizer)
            apply_rank_offload(ds_config, offload, self.dp_rank, optimizer, self.settings.offload.nvme_path)
            if offload:
                self.rank_offload = tuple((offload[rank][0], float(offload[rank][1])) if rank in offload else
                                          (None, 0.0) for rank in range(int(ds_config.world_size)))
            if self.offloaded_ranks and self.dp_rank == 0:
                parts = ", ".join(f"{rank}: {'all' if ratio >= 1 else f'ratio {ratio:g}'}{' on NVMe' * (device == 'nvme')}"
                                  for rank, (device, ratio) in sorted(offload.items()))
                logger.warning(f"deepspeed-hetero: data-parallel rank(s) {list(self.offloaded_ranks)} keep their "
                               f"ZeRO optimizer state off the device ({parts}; zero_optimization.heterogeneous_offload); "
                               "the other ranks keep theirs on the device")
            if self.partition_shares is not None and self.dp_rank == 0:
                logger.warning(f"deepspeed-hetero: ZeRO-{ds_config.zero_optimization_stage} optimizer-state shares "
                               f"per data-parallel rank {describe_shares(self.partition_shares)} "
                               "(heterogeneous_memory.zero_partitions)")
            cap_startup_plan(ds_config, model, optimizer)

    def configure(self, ds_config):
        """Upstream's batch arithmetic, replaced: set this rank's batch fields from the start-up plan
        once the config is coordinated, and provisional ones (the even split) until then. Returns
        False (and does nothing) when the fork is off."""
        if not self.enabled:
            return False
        from .startup import configure_heterogeneous_batch, provisional_batch
        if self.coordinated:
            configure_heterogeneous_batch(ds_config, self)
        else:
            provisional_batch(ds_config, self)
        return True


def _pipeline_process_count(mpu, world_size):
    """The number of processes when ``mpu`` is a pipeline grid with more than one stage (the
    emulation's lists are then per global rank), else None."""
    if mpu is None or not hasattr(mpu, "get_pipe_parallel_world_size"):
        return None
    if int(mpu.get_pipe_parallel_world_size()) <= 1:
        return None
    from deepspeed import comm as dist
    return int(dist.get_world_size())
