# SPDX-License-Identifier: Apache-2.0
"""The tuning space, read from the user's ds_config, and the experiments in it (pure).

Tunable values are given where DeepSpeed reads them, as ``"auto"`` or as a list of candidates,
either at the top level or inside the ``autotuning`` block (which wins)::

    "train_micro_batch_size_per_gpu": "auto" | 4 | [2, 4, 8]
    "gradient_accumulation_steps":    "auto" | 1 | [1, 2]
    "zero_optimization": {"stage": [1, 2], ...the user's other ZeRO settings, kept...}

With a ``PipelineModule(partition_method="heterogeneous")``, the autotuning block may add the
pipeline degree and the fork's partition (the degree reaches the script by its flag)::

    "pipeline": {"num_stages": [1, 2], "partition": ["balanced", "parameters"]}
    "arg_mappings": {"pipeline.num_stages": "--stages"}

An experiment is one (pipeline degree and partition, ZeRO stage, gas, per-rank micro-batch sizes)
point. Its ds_config is the user's config with exactly those values replaced: every other ZeRO
setting (offload, buckets, overlap) is kept, where upstream's micro-batch experiments replaced the
whole block by ``{"stage": n}``.
"""

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from deepspeed.runtime.heterogeneous.planning.strategies import COMPUTE_AWARE, MANUAL, UNIFORM

AUTO = "auto"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH = "train_batch_size"
ZERO = "zero_optimization"
HETERO = "heterogeneous_config"
PIPELINE = "pipeline"
NUM_STAGES = "pipeline.num_stages"
"""The arg_mappings key of the pipeline degree: PipelineModule(num_stages=...) is the script's."""
PARTITIONS = {"balanced": "bal", "parameters": "par", "uniform": "uni"}
"""heterogeneous_config.pipeline.partition values, and their short form in experiment names."""
PIPELINE_STAGES = (0, 1)
"""ZeRO stages DeepSpeed's PipelineEngine accepts (it refuses 2 and 3 at any pipeline degree)."""

# Keys of the autotuning block: upstream's, and the fork's additions (documented in the README).
AUTOTUNING_KEYS = {
    "enabled": "bool",
    "fast": "bool",
    "metric": "'throughput', 'latency' or 'flops'",
    "arg_mappings": "a map from ds_config key to the script's flag",
    "results_dir": "a directory",
    "exps_dir": "a directory",
    "overwrite": "bool",
    "start_profile_step": "int >= 0",
    "end_profile_step": "int > start_profile_step",
    "metric_path": "a file (set per experiment by the tuner)",
    "model_info_path": "a file",
    "model_info": "a map (upstream; not used)",
    "tuner_type": "'gridsearch', 'random' or 'model_based'",
    "tuner_early_stopping": "int >= 1",
    "tuner_num_trials": "int >= 1",
    "mp_size": "int >= 1",
    "max_train_batch_size": "int",
    "min_train_batch_size": "int",
    "max_train_micro_batch_size_per_gpu": "int >= 1",
    "min_train_micro_batch_size_per_gpu": "int >= 1",
    "num_tuning_micro_batch_sizes": "int >= 1",
    "experiment_timeout": "seconds > 0 (default 1800)",
    "seed": "int (random and model_based tuners)",
    MBS: "'auto', an int or a list of ints",
    GAS: "'auto', an int or a list of ints",
    ZERO: "{'stage': int or list of 0-3}",
    PIPELINE: "{'num_stages': int or list of ints, 'partition': name or list of 'balanced', 'parameters', "
              "'uniform'}",
}
METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")
STAGES = (0, 1, 2, 3)


class AutotuningConfigError(ValueError):
    """The autotuning settings or the tuning space are wrong; the message names the key."""


@dataclass
class Settings:
    fast: bool = True
    metric: str = "throughput"
    arg_mappings: Dict[str, str] = field(default_factory=dict)
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    max_train_batch_size: Optional[int] = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    experiment_timeout: float = 1800.0
    seed: int = 0


def _int(value, key, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise AutotuningConfigError(f"autotuning.{key} = {value!r}: must be an integer >= {low}")
    return value


def parse_settings(ds_config):
    """The ``autotuning`` block as Settings; AutotuningConfigError names a wrong key or value."""
    block = ds_config.get("autotuning")
    if not isinstance(block, dict):
        raise AutotuningConfigError("the ds_config has no 'autotuning' block: add \"autotuning\": {\"enabled\": true} "
                                    "(see the README's autotuning section)")
    unknown = sorted(set(block) - set(AUTOTUNING_KEYS))
    if unknown:
        raise AutotuningConfigError(f"autotuning: unknown key(s) {unknown}; allowed keys: "
                                    f"{', '.join(sorted(AUTOTUNING_KEYS))}")
    settings = Settings()
    for key in ("fast", "overwrite"):
        if key in block:
            if not isinstance(block[key], bool):
                raise AutotuningConfigError(f"autotuning.{key} = {block[key]!r}: must be true or false")
            setattr(settings, key, block[key])
    if "metric" in block:
        if block["metric"] not in METRICS:
            raise AutotuningConfigError(f"autotuning.metric = {block['metric']!r}: use one of {', '.join(METRICS)}")
        settings.metric = block["metric"]
    if "tuner_type" in block:
        if block["tuner_type"] not in TUNERS:
            raise AutotuningConfigError(f"autotuning.tuner_type = {block['tuner_type']!r}: use one of "
                                        f"{', '.join(TUNERS)}")
        settings.tuner_type = block["tuner_type"]
    mappings = block.get("arg_mappings") or {}
    if not isinstance(mappings, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.startswith("-")
                                                 for k, v in mappings.items()):
        raise AutotuningConfigError(f"autotuning.arg_mappings = {mappings!r}: must map ds_config keys to the "
                                    f"script's flags, e.g. {{\"{MBS}\": \"--per_device_train_batch_size\"}}")
    bad = sorted(set(mappings) - {MBS, GAS, BATCH, NUM_STAGES})
    if bad:
        raise AutotuningConfigError(f"autotuning.arg_mappings: {bad} cannot be mapped; mappable keys: {MBS}, {GAS}, "
                                    f"{BATCH}, {NUM_STAGES}")
    settings.arg_mappings = dict(mappings)
    for key in ("results_dir", "exps_dir"):
        if key in block:
            if not isinstance(block[key], str) or not block[key]:
                raise AutotuningConfigError(f"autotuning.{key} = {block[key]!r}: must be a non-empty path")
            setattr(settings, key, block[key])
    for key, low in (("start_profile_step", 0), ("end_profile_step", 1), ("tuner_early_stopping", 1),
                     ("tuner_num_trials", 1), ("min_train_batch_size", 1), ("max_train_micro_batch_size_per_gpu", 1),
                     ("min_train_micro_batch_size_per_gpu", 1), ("num_tuning_micro_batch_sizes", 1), ("seed", 0)):
        if key in block and block[key] is not None:
            setattr(settings, key, _int(block[key], key, low))
    if block.get("max_train_batch_size") is not None:
        settings.max_train_batch_size = _int(block["max_train_batch_size"], "max_train_batch_size", 1)
    if settings.end_profile_step <= settings.start_profile_step:
        raise AutotuningConfigError(f"autotuning.end_profile_step ({settings.end_profile_step}) must exceed "
                                    f"start_profile_step ({settings.start_profile_step}): the metric is the mean "
                                    f"over the steps between them")
    if settings.min_train_micro_batch_size_per_gpu > settings.max_train_micro_batch_size_per_gpu:
        raise AutotuningConfigError("autotuning.min_train_micro_batch_size_per_gpu exceeds "
                                    "max_train_micro_batch_size_per_gpu")
    if "experiment_timeout" in block:
        value = block["experiment_timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise AutotuningConfigError(f"autotuning.experiment_timeout = {value!r}: must be a number of seconds > 0")
        settings.experiment_timeout = float(value)
    return settings


def _candidates(value, key, default):
    """'auto' -> default; int -> [int]; list of ints -> sorted unique list."""
    if value is None or value == AUTO:
        return list(default)
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise AutotuningConfigError(f"{key} = {value!r}: use 'auto', a positive integer or a list of them")
    return sorted(set(values))


@dataclass(frozen=True)
class PipelineSpace:
    """The pipeline dimension: degrees (each divides the ranks) and the fork's partitions."""

    degrees: Tuple[int, ...]
    partitions: Tuple[str, ...]
    flag: str
    """The script's flag for the degree (autotuning.arg_mappings["pipeline.num_stages"])."""

    def points(self):
        """(degree, partition) pairs to try; one stage has no cut, so its partition is None."""
        return [(d, p) for d in self.degrees for p in (self.partitions if d > 1 else (None, ))]


@dataclass
class TuningSpace:
    stages: List[int]
    gas: List[int]
    micro_batch_sizes: Optional[List[int]]
    """Per-rank (uniform) sizes to try; None: 'auto' (the tuner derives them from memory)."""
    train_batch_size: Optional[int]
    """Fixed by the user: every experiment keeps it (sum(mbs) * gas == train_batch_size)."""
    world_size: int
    heterogeneous: bool
    """The user's config enables heterogeneous_config: per-rank allocations are tuned."""
    pipeline: Optional[PipelineSpace] = None
    gas_by_degree: Dict[int, List[int]] = field(default_factory=dict)
    """With a pipeline and a fixed train_batch_size: each degree's gas (its replicas differ)."""
    notes: List[str] = field(default_factory=list)
    """What was left out of the space and why (the tuner prints them)."""

    def replicas(self, degree):
        """Data-parallel replicas at a pipeline degree (degree None: no pipeline, every rank)."""
        return self.world_size // (degree or 1)

    def gas_for(self, degree):
        return self.gas_by_degree.get(degree, self.gas)


def _listed(value, key, allowed, kind):
    values = value if isinstance(value, list) else [value]
    if not values or not all(allowed(v) for v in values):
        raise AutotuningConfigError(f"{key} = {value!r}: use {kind} or a list of them")
    return values


def parse_pipeline(block, ds_config, settings, world_size):
    """The ``autotuning.pipeline`` block as a PipelineSpace (None without one) and notes on the
    degrees left out; AutotuningConfigError names a wrong key, value or missing mapping."""
    value = block.get(PIPELINE)
    if value is None:
        return None, []
    where = f"autotuning.{PIPELINE}"
    if not isinstance(value, dict):
        raise AutotuningConfigError(f"{where} = {value!r}: must be a map, e.g. {{\"num_stages\": [1, 2], "
                                    f"\"partition\": [\"balanced\", \"parameters\"]}}")
    unknown = sorted(set(value) - {"num_stages", "partition"})
    if unknown:
        raise AutotuningConfigError(f"{where}: unknown key(s) {unknown}; allowed keys: num_stages, partition")
    if "num_stages" not in value:
        raise AutotuningConfigError(f"{where}.num_stages is missing: give the pipeline degrees to try, e.g. [1, 2]")
    degrees = _listed(value["num_stages"], f"{where}.num_stages",
                      lambda d: isinstance(d, int) and not isinstance(d, bool) and d >= 1, "a positive integer")
    partitions = _listed(value.get("partition", "balanced"), f"{where}.partition", lambda p: p in PARTITIONS,
                         f"one of {', '.join(repr(p) for p in PARTITIONS)}")
    flag = settings.arg_mappings.get(NUM_STAGES)
    if flag is None:
        raise AutotuningConfigError(f"{where}.num_stages is tuned, but autotuning.arg_mappings has no "
                                    f"\"{NUM_STAGES}\": name the flag your script reads for PipelineModule("
                                    f"num_stages=...), e.g. \"arg_mappings\": {{\"{NUM_STAGES}\": \"--stages\"}}")
    hetero = ds_config.get(HETERO) or {}
    if not hetero.get("enabled"):
        raise AutotuningConfigError(f"{where} needs heterogeneous_config.enabled: true: the partition is "
                                    f"heterogeneous_config.pipeline.partition, read when the fork builds a "
                                    f"PipelineModule(partition_method=\"heterogeneous\") (docs/pipeline.md)")
    if (hetero.get("scheduler") or {}).get("dynamic_rebalancing"):
        raise AutotuningConfigError(f"{where}: heterogeneous_config.scheduler.dynamic_rebalancing is true, which a "
                                    f"PipelineModule refuses (its replicas keep their start-up plan): set it to false")
    if (hetero.get(PIPELINE) or {}).get("stage_layers"):
        raise AutotuningConfigError(f"{where}: heterogeneous_config.pipeline.stage_layers is a manual cut for one "
                                    f"degree, and it wins over the partition: remove it to tune the pipeline")
    notes = []
    kept = sorted({d for d in degrees if world_size % d == 0})
    left = sorted(set(degrees) - set(kept))
    if left:
        notes.append(f"{where}.num_stages {left} left out: a degree must divide the {world_size} rank(s)")
    if not kept:
        raise AutotuningConfigError(f"{where}.num_stages = {value['num_stages']!r}: no degree divides the "
                                    f"{world_size} rank(s) this command starts")
    ordered = tuple(p for p in PARTITIONS if p in partitions)
    if ordered and kept == [1] and "partition" in value:
        notes.append(f"{where}.partition {list(ordered)} not tuned: one stage has no cut")
    return PipelineSpace(degrees=tuple(kept), partitions=ordered, flag=flag), notes


def parse_space(ds_config, settings, world_size):
    block = ds_config.get("autotuning") or {}
    pipeline, notes = parse_pipeline(block, ds_config, settings, world_size)

    def pick(key):
        return block[key] if key in block else ds_config.get(key)

    def where(key):
        """The key as the user wrote it: tuning lists may sit in the autotuning block."""
        return f"autotuning.{key}" if key in block else key

    zero_key = where(ZERO) if isinstance(block.get(ZERO), dict) else ZERO
    zero = block.get(ZERO) if isinstance(block.get(ZERO), dict) else ds_config.get(ZERO) or {}
    if not isinstance(zero, dict):
        raise AutotuningConfigError(f"{ZERO} = {zero!r}: must be a map")
    stage = zero.get("stage", AUTO)
    # Upstream tuned only ZeRO-0 unless stages were named; "auto" or no stage means all of them.
    if stage in (None, AUTO):
        stages = list(STAGES)
    else:
        stages = stage if isinstance(stage, list) else [stage]
        if not stages or not all(s in STAGES and not isinstance(s, bool) for s in stages):
            raise AutotuningConfigError(f"{zero_key}.stage = {stage!r}: use 'auto', a stage (0, 1, 2 or 3) or a "
                                        f"list of them")
        stages = sorted(set(stages))
    if pipeline is not None:
        kept = [s for s in stages if s in PIPELINE_STAGES]
        if not kept:
            raise AutotuningConfigError(f"{zero_key}.stage = {stage!r}: with autotuning.{PIPELINE}, ZeRO stage 0 or 1 "
                                        f"only (DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3)")
        if kept != stages:
            notes.append(f"ZeRO stages {[s for s in stages if s not in kept]} left out: DeepSpeed's PipelineEngine "
                         f"refuses ZeRO-2 and ZeRO-3 (any pipeline degree)")
        stages = kept
    gas_value = pick(GAS)
    gas = _candidates(gas_value, where(GAS), [1] if settings.fast else [1, 2])
    mbs_value = pick(MBS)
    mbs = None if mbs_value in (None, AUTO) else _candidates(mbs_value, where(MBS), [])
    hetero = bool((ds_config.get(HETERO) or {}).get("enabled"))
    batch = ds_config.get(BATCH)
    if batch == AUTO:
        batch = None
    if batch is not None:
        batch = _candidates(batch, BATCH, [])
        if len(batch) != 1:
            raise AutotuningConfigError(f"{BATCH} = {ds_config.get(BATCH)!r}: give one global batch or 'auto'")
        batch = batch[0]
        if pipeline is None:
            gas = _gas_for_fixed_batch(batch, gas, gas_value in (None, AUTO), mbs, world_size, hetero, where)
        else:
            gas_by_degree, pipeline = _gas_per_degree(batch, gas, gas_value in (None, AUTO), mbs, world_size,
                                                      pipeline, where, notes)
    space = TuningSpace(stages=stages, gas=gas, micro_batch_sizes=mbs, train_batch_size=batch, world_size=world_size,
                        heterogeneous=hetero, pipeline=pipeline, notes=notes)
    if pipeline is not None and batch is not None:
        space.gas_by_degree = gas_by_degree
    return space


def _gas_per_degree(batch, gas, gas_auto, mbs, world, pipeline, where, notes):
    """A fixed global batch at each pipeline degree: its world/degree replicas split it (the
    fork's replica plan splits unevenly, as with heterogeneous_config on). A degree that cannot
    give the batch is left out with a note; none: the first degree's error."""
    by_degree, errors = {}, []
    for degree in pipeline.degrees:
        try:
            by_degree[degree] = _gas_for_fixed_batch(batch, gas, gas_auto, mbs, world // degree, True, where)
        except AutotuningConfigError as exc:
            errors.append(exc)
            notes.append(f"pipeline degree {degree} left out ({world // degree} replica(s)): {exc}")
    if not by_degree:
        raise errors[0]
    return by_degree, dataclasses.replace(pipeline, degrees=tuple(sorted(by_degree)))


def _gas_for_fixed_batch(batch, gas, gas_auto, mbs, world, hetero, where):
    """The accumulation steps that keep a fixed global batch: every rank needs a sample per
    micro-step; without heterogeneous_config the ranks split it evenly; with listed micro-batch
    sizes (with 'auto' gas: any divisor) the batch must be ranks x size x gas for one of them."""
    if batch < world:
        raise AutotuningConfigError(f"{BATCH} {batch} is smaller than the {world} data-parallel ranks: every rank "
                                    f"needs at least one sample per micro-step")
    if mbs is not None and gas_auto:
        gas = [g for g in range(1, batch + 1) if batch % g == 0]
    shown = "any" if mbs is not None and gas_auto else gas
    gas = [g for g in gas if batch % g == 0 and batch // g >= world]
    if not gas:
        raise AutotuningConfigError(f"{BATCH} {batch} leaves no gradient_accumulation_steps in {shown} that divides "
                                    f"it with at least one sample per rank per micro-step")
    if not hetero:
        even = [g for g in gas if (batch // g) % world == 0]
        if not even:
            raise AutotuningConfigError(
                f"{BATCH} {batch} cannot be split evenly over {world} ranks with gradient_accumulation_steps in "
                f"{shown}: without heterogeneous_config every rank runs the same micro-batch, so {BATCH} must be "
                f"ranks x micro-batch x gas; change it, or enable heterogeneous_config for uneven per-rank splits")
        gas = even
    if mbs is not None:
        fitting = [g for g in gas if (batch // g) % world == 0 and (batch // g) // world in mbs]
        if not fitting:
            sizes = sorted({batch // g // world for g in gas if (batch // g) % world == 0})
            hint = (f"list sizes from {sizes}" if sizes else
                    f"no size can ({BATCH} / gas is never a multiple of {world})")
            raise AutotuningConfigError(
                f"{BATCH} {batch} is fixed, and none of {where(MBS)} {mbs} gives it on {world} ranks with "
                f"gradient_accumulation_steps in {shown} ({BATCH} = ranks x micro-batch x gas): {hint}; or leave "
                f"{where(MBS)} 'auto'")
        gas = fitting
    return gas


@dataclass(frozen=True)
class Experiment:
    stage: int
    gas: int
    micro_batch_sizes: Tuple[int, ...]
    """One size per data-parallel rank; all equal for a uniform experiment."""
    heterogeneous: bool = False
    """Run through heterogeneous_config (manual plan, or uniform on an emulated cluster)."""
    profile: bool = False
    """The profiling run: compute_aware with profiling steps; measures every rank's models."""
    pipeline_stages: Optional[int] = None
    """The pipeline degree passed to the script (None: no pipeline tuned); micro_batch_sizes then
    has one entry per replica, which compute_aware re-splits by the replicas' speeds."""
    partition: Optional[str] = None
    """heterogeneous_config.pipeline.partition (None with one stage: no cut)."""

    @property
    def uniform(self):
        return len(set(self.micro_batch_sizes)) == 1

    @property
    def train_batch_size(self):
        return sum(self.micro_batch_sizes) * self.gas

    @property
    def name(self):
        if self.profile:
            return f"profile_z{self.stage}_gas{self.gas}_tbs{self.train_batch_size}"
        sizes = str(self.micro_batch_sizes[0]) if self.uniform else "-".join(map(str, self.micro_batch_sizes))
        return f"{self.pipeline_prefix}z{self.stage}_gas{self.gas}_tmbspg{sizes}"

    @property
    def pipeline_prefix(self):
        """``pp2bal_``: degree 2, balanced partition; ``pp1_``: one stage; '' without a pipeline."""
        if self.pipeline_stages is None:
            return ""
        return f"pp{self.pipeline_stages}{PARTITIONS.get(self.partition, '')}_"

    def ds_config(self, user_config, metric_path, settings, profile_steps=3):
        """The user's config with this experiment's values; tuning lists and 'auto' removed."""
        config = copy.deepcopy(user_config)
        block = config.get("autotuning") or {}
        for key in (MBS, GAS, ZERO, PIPELINE):
            block.pop(key, None)
        block.update(enabled=True, metric=settings.metric, metric_path=metric_path,
                     start_profile_step=settings.start_profile_step, end_profile_step=settings.end_profile_step)
        block.pop("model_info", None)  # upstream's model-info run stops the script after one step
        config["autotuning"] = block
        zero = dict(config.get(ZERO) or {})
        zero["stage"] = self.stage
        config[ZERO] = zero
        config[BATCH] = self.train_batch_size
        config[GAS] = self.gas
        hetero = dict(config.get(HETERO) or {})
        if self.pipeline_stages is not None:
            config.pop(MBS, None)
            # The replicas' plan follows their pipelines' speeds as the engine starts (no profiling
            # steps with a pipeline); with one replica it is the whole batch.
            hetero.update(enabled=True, load_balancing_strategy=COMPUTE_AWARE)
            hetero.pop("micro_batch_sizes", None)
            if self.partition is not None:
                hetero["pipeline"] = {**(hetero.get("pipeline") or {}), "partition": self.partition}
        elif self.profile:
            config.pop(MBS, None)
            hetero.update(enabled=True, load_balancing_strategy=COMPUTE_AWARE, profile_steps=profile_steps)
            hetero.pop("micro_batch_sizes", None)
        elif self.heterogeneous:
            config.pop(MBS, None)
            hetero.update(enabled=True)
            if self.uniform:
                hetero.update(load_balancing_strategy=UNIFORM)
                hetero.pop("micro_batch_sizes", None)
            else:
                hetero.update(load_balancing_strategy=MANUAL, micro_batch_sizes=list(self.micro_batch_sizes))
        else:
            config[MBS] = self.micro_batch_sizes[0]
        if self.profile or self.heterogeneous or self.pipeline_stages is not None:
            scheduler = dict(hetero.get("scheduler") or {})
            scheduler.pop("type", None)
            scheduler["dynamic_rebalancing"] = False  # an experiment measures one fixed plan
            hetero["scheduler"] = scheduler
            config[HETERO] = hetero
        return config


def replica_micro_batches(metrics, replicas):
    """The per-replica micro-batches a pipeline experiment ran, from its metrics: global rank g is
    stage g // replicas, replica g % replicas, so stage 0's ranks are the first ``replicas``."""
    ranks = sorted(metrics.get("ranks") or [], key=lambda entry: entry["rank"])
    if len(ranks) < replicas:
        return None
    return [int(entry["micro_batch_size"]) for entry in ranks[:replicas]]


def interpolate(uniform, target, fraction):
    """Integer sizes on the line from ``uniform`` to ``target`` at ``fraction`` (may exceed 1),
    each >= 1, summing to sum(uniform); None when the point leaves the valid range."""
    total = sum(uniform)
    raw = [u + fraction * (t - u) for u, t in zip(uniform, target)]
    if any(value < 1 for value in raw):
        return None
    sizes = [max(1, int(math.floor(value))) for value in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order[:total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes) if sum(sizes) == total else None


def optimal_ds_config(experiment_config, user_config):
    """The best experiment's config made for training: autotuning off, and the user's own
    heterogeneous scheduler settings back (experiments measure one fixed plan).

    With the user's dynamic rebalancing on, the plan cannot be a fixed (manual) one: the config
    keeps the tuned stage, gas and global batch and lets compute_aware find and follow the plan.
    """
    config = copy.deepcopy(experiment_config)
    block = config.get("autotuning") or {}
    block["enabled"] = False  # trains; does not stop after the measuring window
    block.pop("metric_path", None)
    config["autotuning"] = block
    hetero = config.get(HETERO)
    if hetero is None:
        return config
    scheduler = copy.deepcopy((user_config.get(HETERO) or {}).get("scheduler"))
    if scheduler is None:
        hetero.pop("scheduler", None)
        return config
    scheduler.pop("type", None)  # the strategy is load_balancing_strategy's
    hetero["scheduler"] = scheduler
    if scheduler.get("dynamic_rebalancing"):
        hetero["load_balancing_strategy"] = COMPUTE_AWARE
        hetero.pop("micro_batch_sizes", None)
    return config
