# SPDX-License-Identifier: Apache-2.0
"""The tuning space, read from the user's ds_config (pure).

Tunable values are given where DeepSpeed reads them, as ``"auto"`` or as a list of candidates,
either at the top level or inside the ``autotuning`` block (which wins)::

    "train_micro_batch_size_per_gpu": "auto" | 4 | [2, 4, 8]
    "gradient_accumulation_steps":    "auto" | 1 | [1, 2]
    "zero_optimization": {"stage": [1, 2], ...the user's other ZeRO settings, kept...}

With a ``PipelineModule(partition_method="heterogeneous")``, the autotuning block may add the
pipeline degree and the fork's partition (the degree reaches the script by its flag)::

    "pipeline": {"num_stages": [1, 2], "partition": ["balanced", "parameters"]}
    "arg_mappings": {"pipeline.num_stages": "--stages"}

The autotuning block's own settings are ``settings.py``'s; an experiment, one point of the space,
is ``experiment.py``'s.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .settings import AUTO, BATCH, GAS, HETERO, MBS, NUM_STAGES, PIPELINE, ZERO, AutotuningConfigError

PARTITIONS = {"balanced": "bal", "parameters": "par", "uniform": "uni"}
"""heterogeneous_config.pipeline.partition values, and their short form in experiment names."""
PIPELINE_STAGES = (0, 1)
"""ZeRO stages DeepSpeed's PipelineEngine accepts (it refuses 2 and 3 at any pipeline degree)."""
STAGES = (0, 1, 2, 3)


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
