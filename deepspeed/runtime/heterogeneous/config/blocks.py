# SPDX-License-Identifier: Apache-2.0
"""The fork's pydantic blocks: ``heterogeneous_config`` (sub-blocks scheduler, emulation, communication,
pipeline, elastic, loss_items), ``heterogeneous_memory``, ``zero_optimization.heterogeneous_offload``.
Every model forbids unknown keys; ``settings.py`` loads them and words their errors."""

import re
from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, Field, PositiveFloat, PositiveInt, WithJsonSchema,
                      field_validator, model_validator)

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from .strategies import get_strategy, strategy_names, unknown_strategy_message


def _registered_strategy(name):
    if not isinstance(name, str) or name not in strategy_names():
        raise ValueError(unknown_strategy_message(name))
    return name


Strategy = Annotated[str, BeforeValidator(_registered_strategy),
                     WithJsonSchema({"type": "string", "description": "a registered load-balancing strategy"})]
"""The name of a registered load-balancing strategy (``strategies.py``)."""

class SchedulerConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.scheduler``: how and when the work split is revised."""

    type: Optional[Strategy] = None
    """The strategy, named in the scheduler block (as the top-level ``scheduler`` block names it);
    when given it must agree with load_balancing_strategy."""
    dynamic_rebalancing: bool = False
    """Re-plan during training when measured speeds drift (also on with DS_ADAPTIVE_SCHEDULING=true)."""
    imbalance_threshold: float = Field(0.1, gt=0.0, lt=1.0)
    """Minimum predicted step-time gain (fraction) that justifies a new plan."""
    check_interval: PositiveInt = 20
    """Steps between two imbalance checks."""
    cooldown_checks: int = Field(1, ge=0)
    """Checks skipped after a rebalance: the new plan is measured for a whole interval before it
    can be judged (and its observed gain logged)."""


def _relative_speed(speed):
    if not 0.0 < speed <= 1.0:
        raise ValueError(f"{speed} is not in (0, 1]: each speed is relative to the fastest device (1.0)")
    return speed


RelativeSpeed = Annotated[float, AfterValidator(_relative_speed),
                          WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": 1})]
"""An emulated rank's speed as a fraction of the unthrottled device, in (0, 1]; an error names its index."""


class SpeedChange(DeepSpeedConfigModel):
    """One entry of ``emulation.speed_schedule``: from optimizer step ``step`` on, rank r runs at
    ``speeds[r]``."""

    step: PositiveInt
    speeds: List[RelativeSpeed]


class EmulationConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.emulation``: an emulated mixed cluster, for tests and demos only."""

    speeds: Optional[List[RelativeSpeed]] = None
    """Relative speed of each data-parallel rank, in (0, 1]; 1.0 is the unthrottled device."""
    memory_gb: Optional[List[PositiveFloat]] = None
    """Emulated device memory of each data-parallel rank, in GB of 2**30 bytes (as the device table);
    the planner keeps each rank within it and a rank that exceeds it fails as out of memory."""
    speed_schedule: Optional[List[SpeedChange]] = None
    """Speed changes during training, e.g. [{"step": 30, "speeds": [1.0, 0.4]}]: a device that
    throttles or gets a noisy neighbour, for tests and benchmarks of dynamic rebalancing."""
    mode: Literal["auto", "cgroup", "dilation"] = "auto"
    """cgroup: a CPU-quota cgroup per rank; dilation: the rank sleeps in proportion to its compute;
    auto: cgroup where the machine allows it, else dilation."""
    dilation_clock: Literal["elapsed", "own"] = "elapsed"
    """What dilation stretches: elapsed, the compute's elapsed time, waits for a core included (a
    slowed rank keeps its ratio to a full-speed rank on a busy machine); own, the rank's own
    compute, its waits for a core other threads or processes held left out (every rank dilated,
    standing for devices that leave the host's cores free)."""

    @model_validator(mode="after")
    def _schedule_steps_increase(self):
        steps = [change.step for change in self.speed_schedule or []]
        if steps != sorted(set(steps)):
            raise ValueError(f"speed_schedule steps {steps} must be increasing, one entry per step")
        return self


def _auto_or_bool(value):
    # A plain bool field would take pydantic's lax spellings ("yes", 1, "on") and an unknown word
    # would come back as two union errors; one message that names the three values is clearer.
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"{value!r} is not allowed; use true, false or \"auto\"")


def _compression_dtype(value):
    if value is False or value is None or value in ("bf16", "fp16", "lossless"):
        return value or False
    raise ValueError(f"{value!r} is not allowed; use false, \"lossless\" (exact), \"bf16\" or \"fp16\"")


AutoOrBool = Annotated[Union[Literal["auto"], bool], BeforeValidator(_auto_or_bool)]
"""true / false / "auto" (on when the fork is enabled and the ranks span more than one host)."""


def _bool(value):
    if value is True or value is False:
        return value
    raise ValueError(f"{value!r} is not allowed; use true or false")


Bool = Annotated[bool, BeforeValidator(_bool)]
"""true / false only (not pydantic's lax "yes", 1, "on")."""


class LowCommunicationConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.communication.low_communication``: how the hosts' replicas meet in
    ``mode: "low_communication"`` (``comm/low_communication.py``, docs/multihost.md). Not exact."""

    sync_every: PositiveInt = 50
    """Optimizer steps each host takes on its own between two synchronisations (H)."""
    outer_lr: PositiveFloat = 1.0
    """The outer step's learning rate: the replicas move by ``outer_lr`` times the (Nesterov) mean of
    their pseudo-gradients. 1.0 with momentum 0 is plain averaging of the replicas."""
    outer_momentum: float = Field(0.5, ge=0.0, lt=1.0)
    """The outer Nesterov momentum (0: none). The defaults (lr 1, momentum 0.5) were the closest to
    exact training of the settings tried on two hosts (tests/perf/bench_low_communication.py);
    DiLoCo's (lr 0.7, momentum 0.9) suit many workers and long periods."""
    pseudo_gradient_dtype: Literal["fp32", "bf16"] = "fp32"
    """What crosses the link: each host's pseudo-gradient in fp32, or rounded to bf16 (half the bytes);
    the mean and the outer step are computed in fp32 either way."""


class CommunicationConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.communication``: how gradients travel on a cluster of several hosts.

    The exact parts are on by default (``auto``) wherever they can matter: the fork is enabled and
    the data-parallel ranks span more than one host (``cluster/topology.py``); a user turns them off
    with ``false``. Compression is opt-in: bf16/fp16 is not exact, and lossless costs CPU time
    that pays only on slow links."""

    hierarchical_reduction: AutoOrBool = "auto"
    """ZeRO-0/1/2 gradient all-reduce in three steps: inside each host, shards between hosts, inside
    each host again (``comm/hierarchical.py``). Equal to the flat all-reduce up to summation order.
    ``true`` where it cannot apply (data-parallel group smaller than the world) is an error."""
    compress_inter_host: Union[Literal["lossless", "bf16", "fp16"], bool] = False
    """``"lossless"``: code what the host leaders exchange (gradient partials, ZeRO-1/2's updated
    partitions) and ZeRO-3's host-shard refresh between hosts bit for bit (``comm/lossless.py``):
    exact, about 0.84 of the fp32 bytes (0.67 of bf16), for some CPU time per message.
    ``"bf16"``/``"fp16"``: send the inter-host step of the hierarchical reduction in that dtype
    (in-host steps stay in the gradient's dtype); not exact, the sum between hosts is rounded to 8
    (bf16) or 11 (fp16) mantissa bits. Needs hierarchical_reduction in force."""
    overlap: AutoOrBool = "auto"
    """ZeRO-1/2: each full gradient bucket's hierarchical reduction runs in a background thread
    while the backward goes on; the step waits only for the buckets still on the wire when it ends
    (``comm/overlap.py``). Bitwise equal to the reduction without overlap. ``auto``: on wherever
    the hierarchical reduction is in force for ZeRO-1/2 and the buckets can be captured exactly;
    ``true`` where it cannot apply is an error naming why."""
    overlap_parameter_gather: Bool = False
    """ZeRO-1/2: the all-gather of the updated parameters after each step runs in the overlap worker
    during the next forward, each module waiting only for its own parameters
    (``comm/parameter_gather.py``). Bitwise equal to the gather in the step. Opt-in: code that reads
    a parameter outside its module's forward between ``step()`` and the next forward must call
    ``engine.wait_for_parameters()`` first. Needs ``overlap`` in force; ``true`` where it cannot apply
    is an error naming why, except where the hierarchical reduction is not in force (one host, one
    rank per host), where there is nothing to defer, as for ``overlap``."""
    zero3_host_shards: AutoOrBool = "auto"
    """ZeRO-3: each host keeps a copy of the parameters cut among its ranks, refreshed once after each
    step, so parameter gathers run inside the host instead of over every rank
    (``comm/host_shards.py``). Bitwise equal to the flat gather; costs about ``N / ranks_per_host``
    more parameter memory per rank. ``auto``: on wherever the hierarchical reduction is in force for
    ZeRO-3 (and neither hpZ, parameter offload, quantized weights nor MoE is used); ``true`` where it
    cannot apply is an error naming why."""
    link_aware_buckets: AutoOrBool = "auto"
    """ZeRO's gradient bucket size from the slowest measured inter-host link
    (``comm/link_buckets.py``) instead of upstream's one default for every link; the same size on
    every rank, and a size the config sets itself is kept. ``auto`` and ``true``: on when the fork is
    enabled, the ranks span hosts and a link bandwidth was measured (``true`` warns when not)."""

    mode: Literal["exact", "low_communication"] = "exact"
    """exact: every step's gradients are reduced over every rank (the trained model is single-process
    training's). low_communication: each host trains its own replica (exact and balanced inside the
    host) and the hosts synchronise every ``low_communication.sync_every`` steps through an outer
    optimizer step, DiLoCo-style: far fewer bytes between hosts, **not** the single-process model."""
    low_communication: Optional[LowCommunicationConfig] = None
    """The outer synchronisation of ``mode: "low_communication"`` (None: its defaults)."""

    @field_validator("compress_inter_host", mode="before")
    @classmethod
    def _known_compression(cls, value):
        return _compression_dtype(value)

    @model_validator(mode="after")
    def _compression_needs_hierarchy(self):
        if self.compress_inter_host and self.hierarchical_reduction is False:
            raise ValueError(f"compress_inter_host '{self.compress_inter_host}' compresses the inter-host step of "
                             "the hierarchical reduction, which hierarchical_reduction false turns off: drop one")
        if self.zero3_host_shards is True and self.hierarchical_reduction is False:
            raise ValueError("zero3_host_shards true rides on the hierarchical reduction's host groups, which "
                             "hierarchical_reduction false turns off: drop one")
        if self.overlap_parameter_gather and (self.overlap is False or self.hierarchical_reduction is False):
            raise ValueError("overlap_parameter_gather true runs in the overlapped reduction's worker, which "
                             f"{'overlap' if self.overlap is False else 'hierarchical_reduction'} false turns off: "
                             "drop one")
        return self

    @model_validator(mode="after")
    def _low_communication_alone(self):
        if self.mode == "exact":
            if self.low_communication is not None:
                raise ValueError("low_communication is set, but mode is \"exact\"; set mode: \"low_communication\" "
                                 "(synchronise the hosts every sync_every steps, not exact) or drop low_communication")
            return self
        if self.low_communication is None:
            self.low_communication = LowCommunicationConfig()
        exact_parts = [f"{key} {value!r}".replace("True", "true") for key, value in
                       (("hierarchical_reduction", self.hierarchical_reduction), ("overlap", self.overlap),
                        ("compress_inter_host", self.compress_inter_host),
                        ("zero3_host_shards", self.zero3_host_shards),
                        ("overlap_parameter_gather", self.overlap_parameter_gather)) if value is True or
                       (key == "compress_inter_host" and value)]
        if exact_parts:
            raise ValueError(f"mode \"low_communication\" reduces gradients inside each host only, so "
                             f"{' and '.join(exact_parts)} has nothing to act on; leave it \"auto\" or false "
                             "(pseudo_gradient_dtype \"bf16\" halves what crosses the link)")
        return self


class LossItemsConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.loss_items``: each rank's loss is a mean over the items of one forward
    argument that are not ``ignore_index`` (tokens of a tagger or language model, pixels of a mask),
    not over its rows. The engine counts them at every training forward, sums the counts over the
    ranks and weights rank r's loss by ``W * items_r / sum(items)``: the update is the mean over
    every item of the global micro-batch, for any split (``data/loss_items.py``)."""

    input: Union[str, Annotated[int, Field(ge=0)]] = "labels"
    """The forward argument whose items the loss averages: a keyword's name, or a positional index."""
    ignore_index: int = -100
    """The value of items the loss leaves out (cross_entropy's ignore_index; 0 for a 0/1 mask)."""
    shift: bool = False
    """Leave out position 0 of the last dimension, as a causal LM's loss that shifts its labels does."""


class PipelineConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.pipeline``: a ``PipelineModule`` built with
    ``partition_method="heterogeneous"`` (docs/pipeline.md)."""

    stage_layers: Optional[List[PositiveInt]] = None
    """Layers per stage, in stage order (the manual partition); None: cut where the slowest stage's
    cost / speed is least."""
    layer_cost: Literal["measured", "parameters"] = "measured"
    """measured: each layer's forward and backward timed on the first micro-batch of the engine's
    training_data as the engine starts (parameters when no training_data is given); parameters: its
    trainable parameters, as upstream's 'parameters' method weighs it."""
    save_layer_states: bool = True
    """Each stage also saves its layers' optimizer state by layer, so that a checkpoint loads into
    another cut of the layers (pipeline/checkpoint.py); false: a checkpoint resumes into its own
    cut only, and takes no more disk than upstream's."""
    partition: Literal["balanced", "parameters", "uniform"] = "balanced"
    """balanced: the cut where the slowest stage's cost / speed is least, within each stage's
    memory; parameters and uniform: upstream's cuts of the same names (the speeds are ignored), so
    that the autotuner and benchmarks can compare them without changing the script."""


class PeriodicCheckpointConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.elastic.checkpoint``: checkpoints taken by the engine itself at step
    boundaries, so that a run restarted after a failure (``torchrun --max-restarts``) loses little
    (``elastic/periodic.py``). Every rank decides alike: by the step count, or by the slowest
    rank's elapsed time gathered at a step boundary."""

    dir: str
    """Where the tags go (``global_step<N>``) and the ``latest`` file, written only once every rank
    has finished the tag's files."""
    every_steps: Optional[PositiveInt] = None
    """Save after every this many optimizer steps."""
    every_seconds: Optional[float] = Field(None, gt=0)
    """Save once this many seconds have passed since the last save (the slowest rank's clock,
    agreed at a step boundary)."""
    keep_last: int = Field(2, ge=0)
    """Tags kept, the newest first (0: all); the one ``latest`` names is never removed."""

    @model_validator(mode="after")
    def _one_trigger(self):
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("set every_steps, every_seconds or both: when to save")
        return self


class ElasticConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.elastic``: runs whose devices change between a save and a load
    (docs/elastic.md)."""

    repartition: bool = True
    """``load_checkpoint`` of a ZeRO-1/2/3 checkpoint saved on another number of ranks or with other
    memory shares converts it to a universal checkpoint (once per tag, by global rank 0) and loads
    that, which re-partitions the optimizer state for this run; false: such a load is refused by name,
    as upstream refuses it."""
    conversion_dir: Optional[str] = None
    """Where the universal form of a tag is written (``<conversion_dir>/<tag>``); None: beside the tag
    (``<load_dir>/<tag>.universal``). Set it when the checkpoint folder is read-only. It must be
    one folder visible to every rank."""
    checkpoint: Optional[PeriodicCheckpointConfig] = None
    """Periodic checkpoints (None: only those the script takes)."""


class HeterogeneousConfig(DeepSpeedConfigModel):
    """``heterogeneous_config``: per-device work allocation. Off by default (upstream behaviour)."""

    enabled: bool = False
    load_balancing_strategy: Strategy = "compute_aware"
    mixed_precision_support: Literal["config", "adaptive", "bf16", "fp16", "fp32"] = "config"
    """config: the ds_config's own fp16/bf16 blocks decide; adaptive: bf16 when every rank supports
    it, else fp16; bf16/fp16/fp32: forced, failing when a rank cannot run it."""
    micro_batch_sizes: Optional[Union[List[PositiveInt], Dict[str, PositiveInt]]] = None
    """manual strategy: one micro-batch size per data-parallel rank, or a map device name -> size."""
    profile_steps: int = Field(5, ge=0)
    """Steps timed at start-up to replace the spec-sheet prior with measured speeds. 5 by default:
    with 3 and gas 1 each rank has two micro-steps, too few to tell its noise from its fixed cost
    (tests/perf/bench_profiling_gate.py)."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    emulation: Optional[EmulationConfig] = None
    check_fed_batch: bool = True
    """Stop when a rank is fed a micro-batch whose size (dim 0 of the first tensor passed to forward)
    is not its planned one; turn off only for inputs that are not batch-first."""
    resplit_fed_batches: AutoOrBool = "auto"
    """Move whole samples between ranks before the forward so that each computes its planned share
    of what the ranks were fed (``data/resplit.py``). ``auto``: whenever neither the engine's loader
    nor a registered heterogeneous sampler feeds the ranks (a stock ``DistributedSampler``,
    Accelerate or Trainer loader); ``false``: such a loader is refused once the plan changes."""
    return_outputs: bool = True
    """With re-splitting, return each output to the rank that was fed its sample, so that a loss or
    metric computed outside the model pairs outputs with the caller's labels; ``false`` saves that
    exchange when the loss is computed inside the model (outputs then follow the computed rows)."""
    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    """How gradients travel between hosts (hierarchical reduction, inter-host compression)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """How a PipelineModule's layers are cut into stages (``partition_method="heterogeneous"``)."""
    loss_items: Optional[LossItemsConfig] = None
    """A loss that is a mean over valid items rather than rows (None: over rows, the default): see
    ``LossItemsConfig``."""
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    """Loading onto another world and periodic checkpoints (``ElasticConfig``)."""

    @property
    def strategy(self):
        """The registered ``BalancingStrategy`` that ``load_balancing_strategy`` names."""
        return get_strategy(self.load_balancing_strategy)

    @model_validator(mode="after")
    def _consistent(self):
        if self.scheduler.type is not None and self.scheduler.type != self.load_balancing_strategy:
            if "load_balancing_strategy" in self.model_fields_set:
                raise ValueError(f"scheduler.type '{self.scheduler.type}' contradicts load_balancing_strategy "
                                 f"'{self.load_balancing_strategy}': keep one of them")
            self.load_balancing_strategy = self.scheduler.type
        strategy, name = self.strategy, self.load_balancing_strategy
        taking = [n for n in strategy_names() if get_strategy(n).takes_sizes]
        adapting = [n for n in strategy_names() if get_strategy(n).adapts]
        if strategy.takes_sizes and not self.micro_batch_sizes:
            raise ValueError(f"load_balancing_strategy '{name}' needs micro_batch_sizes (a list with one size per "
                             "data-parallel rank, or a map from device name to size)")
        if self.micro_batch_sizes and not strategy.takes_sizes:
            raise ValueError(f"micro_batch_sizes is only read by load_balancing_strategy {_either(taking)} (got "
                             f"'{name}'): set the strategy to {_either(taking)} or remove the sizes")
        if self.scheduler.dynamic_rebalancing and not strategy.adapts:
            raise ValueError(f"scheduler.dynamic_rebalancing needs a load_balancing_strategy that adapts to measured "
                             f"speeds ({_either(adapting)}; got '{name}')")
        return self


def _either(names):
    quoted = [f"'{n}'" for n in names] or ["(none registered)"]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value):
    """'64GB' -> 64e9, '512MiB' -> 512 * 2**20, an int -> itself. ValueError names what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size; write a number of bytes or e.g. '64GB', '512MiB' "
                         f"(units: {', '.join(u for u in _SIZE_UNITS if u)})")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


class HeterogeneousMemoryConfig(DeepSpeedConfigModel):
    """``heterogeneous_memory``: per-rank memory budgets and host buffers."""

    enabled: bool = False
    adaptive_chunking: bool = True
    """ZeRO's bucket sizes and ZeRO-3's prefetch/live-parameter budgets from the smallest rank's memory."""
    hbm_utilization_threshold: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of each device's memory the planner may fill."""
    cpu_memory_limit: Optional[Union[int, str]] = None
    """Hard limit of pinned host buffers, e.g. '64GB'; None: no limit."""
    zero_partitions: Union[Literal["auto", "even"], List[PositiveFloat]] = "auto"
    """ZeRO-1/2/3 shares of the partitioned state: "auto" (from each rank's memory and speed when
    ``enabled``), "even" (upstream's 1/N), or one share per data-parallel rank summing to 1."""
    activation_bytes_per_sample: Optional[Union[int, str]] = None
    """Activation bytes of one sample ('12MiB', bytes): "auto" shares then leave each rank room for its
    speed's part of every micro-step (``memory/activation_room.py``); None: unknown before step 1."""

    @field_validator("zero_partitions")
    @classmethod
    def _shares_sum_to_one(cls, value):
        if isinstance(value, list) and abs(sum(value) - 1.0) > 1e-6:
            raise ValueError(f"{value} sums to {sum(value):.6g}; give one share per data-parallel rank, "
                             "summing to 1, or \"auto\" / \"even\"")
        return value

    @field_validator("cpu_memory_limit", "activation_bytes_per_sample")
    @classmethod
    def _size_parses(cls, value):
        if value is not None and parse_bytes(value) <= 0:
            raise ValueError(f"{value!r} must be a positive size")
        return value

    @property
    def activation_bytes(self):
        return None if self.activation_bytes_per_sample is None else parse_bytes(self.activation_bytes_per_sample)

    @property
    def cpu_memory_limit_bytes(self):
        return None if self.cpu_memory_limit is None else parse_bytes(self.cpu_memory_limit)


class HeterogeneousOffloadConfig(DeepSpeedConfigModel):
    """``zero_optimization.heterogeneous_offload``: each rank decides alone what it offloads."""

    cpu_offload: bool = False
    nvme_offload: bool = False
    nvme_path: Optional[str] = None

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.nvme_offload and not self.nvme_path:
            raise ValueError("nvme_offload needs nvme_path (a directory on the NVMe device)")
        return self
