# SPDX-License-Identifier: Apache-2.0
"""The allocation rules behind the built-in strategies (``strategies.py``): uniform, manual and
compute_aware.

uniform and manual fix the sizes and only note where a rank exceeds its memory limit;
compute_aware takes the exact integer min-max split (``integer_split.py``) within the limits,
with per-rank gas when allowed and faster. Inputs are validated by ``planner.plan_micro_batches``
first; errors here say what would work instead. Pure logic.
"""

import math

from .integer_split import balance, per_rank_gas_splits
from .plan import Plan, positive_int


def _rank_label(rank, names):
    return f"rank {rank} ({names[rank]})" if names else f"rank {rank}"


def memory_caps(max_micro_batch, world, names):
    """Per-rank limits as ints (None: unlimited); a rank that cannot hold one sample is an error."""
    if max_micro_batch is None:
        return [None] * world
    limits = list(max_micro_batch)
    if len(limits) != world:
        raise ValueError(f"max_micro_batch has {len(limits)} entries for {world} data-parallel ranks")
    caps = []
    for rank, limit in enumerate(limits):
        if limit is not None and not (isinstance(limit, (int, float)) and not math.isnan(limit)):
            raise ValueError(f"max_micro_batch[{rank}] = {limit!r} must be a number of samples or None")
        if limit is not None and limit < 1:
            raise ValueError(f"{_rank_label(rank, names)} cannot train: its memory limit allows 0 samples per "
                             f"micro-step (limit {limit}); free memory (offload, smaller model shard) or remove it")
        caps.append(None if limit is None or math.isinf(limit) else int(limit))
    return caps


def uniform_sizes(batch, gas, world):
    """Equal micro-batches: ``batch / gas / world`` samples per rank and micro-step."""
    if (batch // gas) % world:
        raise ValueError(_uniform_error(batch, gas, world))
    return [batch // gas // world] * world


def _uniform_error(batch, gas, world):
    unit = gas * world
    lower, higher = batch // unit * unit, (batch // unit + 1) * unit
    works = f"{lower} or {higher}" if lower else f"{higher}"
    return (f"strategy 'uniform' splits each micro-step's train_batch_size / gradient_accumulation_steps = "
            f"{batch} / {gas} = {batch // gas} samples equally, which the {world} data-parallel ranks do not "
            f"divide; train_batch_size values that work: {works} (multiples of gas * world size = {unit}), or use "
            f"strategy 'compute_aware' or 'manual'")


def manual_sizes(manual, world, names, batch, gas):
    """The user's sizes: a list per rank or a map device name -> size (``names`` needed then)."""
    if manual is None:
        raise ValueError("strategy 'manual' needs micro_batch_sizes (a list per data-parallel rank or a map from "
                         "device name to size)")
    if isinstance(manual, dict):
        if names is None:
            raise ValueError("manual micro_batch_sizes given by device name need the ranks' device names")
        lowered = {str(key).lower(): value for key, value in manual.items()}
        sizes = []
        for rank, name in enumerate(names):
            if name not in manual and name.lower() not in lowered:
                raise ValueError(f"rank {rank} has device '{name}', which micro_batch_sizes does not name; names "
                                 f"given: {sorted(manual)}; devices in this cluster: {sorted(set(names))}")
            sizes.append(manual[name] if name in manual else lowered[name.lower()])
        where = lambda rank: f"micro_batch_sizes['{names[rank]}'] (rank {rank})"
    else:
        sizes = list(manual)
        if len(sizes) != world:
            raise ValueError(f"manual micro_batch_sizes has {len(sizes)} entries but the data-parallel world has "
                             f"{world} ranks; give one size per rank")
        where = lambda rank: f"micro_batch_sizes[{rank}]"
    for rank, size in enumerate(sizes):
        positive_int(size, f"manual {where(rank)}")
    total = sum(sizes)
    if total * gas != batch:
        raise ValueError(f"manual micro_batch_sizes sum to {total} per micro-step, so {total} * "
                         f"gradient_accumulation_steps {gas} = {total * gas} samples per step, but train_batch_size "
                         f"is {batch}: the sizes must sum to {batch} / {gas} = {batch // gas}")
    return [int(size) for size in sizes]


def fixed_plan(models, sizes, gas, batch, strategy, caps):
    """A plan of given sizes at ``gas``, noting each rank whose size exceeds its memory cap."""
    notes = tuple(f"rank {rank}: micro-batch {size} exceeds its predicted memory limit of {cap} samples"
                  for rank, (size, cap) in enumerate(zip(sizes, caps)) if cap is not None and size > cap)
    return _plan(models, batch, gas, sizes, [1] * len(sizes), strategy, notes)


def _plan(models, batch, gas, sizes, multiples, strategy, notes=()):
    """Rank i runs ``gas * multiples[i]`` micro-steps of ``sizes[i]`` samples."""
    times = [gas * k * model.micro_step_time(m) for model, k, m in zip(models, multiples, sizes)]
    return Plan(sizes, [gas * k for k in multiples], batch, strategy, times, notes)


def _capacity_error(batch, gas, world, caps):
    capacity = sum(caps)
    message = (f"memory limits allow {capacity} samples per micro-step over all ranks (per rank: {caps}), fewer than "
               f"train_batch_size {batch} / gradient_accumulation_steps {gas} = {batch // gas}")
    fitting = [g for g in range(gas + 1, batch + 1) if batch % g == 0 and world <= batch // g <= capacity]
    if fitting:
        message += f"; gradient_accumulation_steps {fitting[0]} would fit"
    return message + "; or lower train_batch_size, or free memory (offload)"


def compute_aware_plan(models, batch, gas, caps, allow_per_rank_gas, strategy):
    """The exact min-max split of ``batch / gas`` samples per micro-step within ``caps``; with
    ``allow_per_rank_gas``, the faster of that and the per-rank-gas candidates (or those alone when
    no equal-gas split fits in memory)."""
    world, units = len(models), batch // gas
    bounded = [units if cap is None else min(cap, units) for cap in caps]
    equal = None
    if sum(bounded) >= units:
        equal = _plan(models, batch, gas, balance(models, units, bounded, [1] * world), [1] * world, strategy)
    splits = per_rank_gas_splits(models, units, bounded) if allow_per_rank_gas else []
    if splits:
        best = min((_plan(models, batch, gas, sizes, multiples, strategy) for sizes, multiples in splits),
                   key=lambda plan: plan.predicted_step_time)
        if equal is None or best.predicted_step_time < equal.predicted_step_time * (1 - 1e-9):
            more = [rank for rank, steps in enumerate(best.gradient_accumulation_steps) if steps > gas]
            shown = ", ".join(map(str, more[:8])) + (f", ... ({len(more)} ranks)" if len(more) > 8 else "")
            return Plan(**{**best.to_dict(), "notes": [f"per-rank gradient accumulation: ranks {shown} run more "
                                                       f"micro-steps because memory caps their micro-batch"]})
    if equal is None:
        raise ValueError(_capacity_error(batch, gas, world, bounded))
    return equal
