# SPDX-License-Identifier: Apache-2.0
"""Who computes how many samples: per-rank micro-batch sizes from per-rank speed (docs/architecture.md §4.1).

Rank i's micro-step is modelled as ``a_i + b_i * mbs`` (a fixed cost per micro-step plus a cost
per sample), fitted from profiling steps or derived from a prior score. The planner splits the
global batch so that ``sum(mbs_i * gas_i) == train_batch_size`` exactly and the slowest rank's
predicted step time is minimal within each rank's memory limit. Pure logic: the engine gathers
the inputs and broadcasts the resulting Plan as JSON.

This module holds the entry points: ``plan_micro_batches`` and the prior-score helpers behind the
engine's scheduling API (``engine.py``).
The pieces live apart, one concern each, and are re-exported here for the rest of the fork:

- ``plan.py``: the ``Plan`` type, its JSON form and its printed table;
- ``time_model.py``: ``TimeModel``, fitting, the plausibility guard and priors from scores;
- ``allocation.py``: the uniform, manual and compute_aware rules;
- ``integer_split.py``: the exact integer min-max split the compute_aware rule uses.
"""

import heapq
import math

from .allocation import compute_aware_plan, manual_plan, memory_caps, uniform_plan
from ..measure.devices import DeviceDescription, find_spec, normalize_scores, spec_score
from .plan import Plan, positive_int
from .time_model import FIXED_SHARE_LIMIT, TimeModel, fit_time_model, plausible_time_model, time_models_from_scores

# The strategies this module plans by; the config's Literal lists the same (tests/unit/heterogeneous/test_layout.py).
STRATEGIES = ("uniform", "compute_aware", "manual")

__all__ = [
    "FIXED_SHARE_LIMIT",
    "Plan",
    "TimeModel",
    "device_score",
    "distribute_workload",
    "fit_time_model",
    "plan_micro_batches",
    "plausible_time_model",
    "schedule_heterogeneous_tasks",
    "time_models_from_scores",
]


def plan_micro_batches(time_models,
                       train_batch_size,
                       gradient_accumulation_steps=1,
                       strategy="compute_aware",
                       max_micro_batch=None,
                       manual=None,
                       device_names=None,
                       allow_per_rank_gas=False):
    """Choose every data-parallel rank's micro-batch size (and, optionally, its gas).

    Args:
        time_models: one TimeModel per data-parallel rank, in rank order.
        train_batch_size: the global batch (samples per optimizer step over all ranks).
        gradient_accumulation_steps: micro-steps per optimizer step (default 1); must divide
            train_batch_size.
        strategy: "uniform" (equal split), "compute_aware" (minimise the slowest rank's predicted
            time; default) or "manual" (sizes from ``manual``).
        max_micro_batch: per-rank memory limits in samples per micro-step (None entries: no limit).
            Default None: no limits. compute_aware respects them; a fixed (uniform/manual) plan
            that exceeds one gets a note.
        manual: for "manual", a list of sizes per rank or a map device name -> size.
        device_names: one device name per rank; needed by a manual map, used in messages.
        allow_per_rank_gas: let compute_aware give ranks different gas (ZeRO-0/1 only; the caller
            decides). Default False: every rank runs ``gradient_accumulation_steps``.

    compute_aware finds the exact integer optimum of the slowest rank's ``gas * (a_i + b_i *
    mbs_i)`` with ``sum(mbs_i) * gas == train_batch_size`` and ``mbs_i <= max_micro_batch[i]``;
    ties go to lower ranks, so every rank computes the same plan. With ``allow_per_rank_gas``, a
    rank whose memory caps its micro-batch may run a multiple of ``gas`` micro-steps instead
    (``sum(mbs_i * gas_i) == train_batch_size``; see ``integer_split.per_rank_gas_splits`` for the
    rule); that
    plan is used only when it is predicted faster than the equal-gas one, or when no equal-gas plan
    fits in memory.

    Returns:
        Plan. Raises ValueError saying what is wrong and what would work.
    """
    models = list(time_models)
    if not models or not all(isinstance(model, TimeModel) for model in models):
        raise ValueError("plan_micro_batches: time_models must be a non-empty list of TimeModel, one per rank")
    world = len(models)
    batch = positive_int(train_batch_size, "train_batch_size")
    gas = positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
    if batch % gas:
        raise ValueError(f"train_batch_size {batch} is not divisible by gradient_accumulation_steps {gas}: every "
                         f"micro-step must hold a whole number of samples")
    per_micro_step = batch // gas
    if per_micro_step < world:
        raise ValueError(f"train_batch_size {batch} / gradient_accumulation_steps {gas} = {per_micro_step} samples "
                         f"per micro-step cannot give each of the {world} data-parallel ranks at least one sample")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if manual is not None and strategy != "manual":
        raise ValueError(f"manual micro-batch sizes are used only by strategy 'manual' (got '{strategy}')")
    names = None if device_names is None else [str(name) for name in device_names]
    if names is not None and len(names) != world:
        raise ValueError(f"device_names has {len(names)} entries for {world} data-parallel ranks")
    caps = memory_caps(max_micro_batch, world, names)

    if strategy == "uniform":
        return uniform_plan(models, batch, gas, caps)
    if strategy == "manual":
        return manual_plan(models, manual, names, batch, gas, caps)
    return compute_aware_plan(models, batch, gas, caps, allow_per_rank_gas)


def device_score(device):
    """Prior speed of one device in TFLOP/s (``engine._get_device_score(dev)`` returns it).

    Args:
        device: a DeviceDescription or its dict (its ``spec_score``: from the datasheet table or
            measured, 0.0 when unknown); a dict with a ``score``; or a device name / a dict with a
            ``name`` (and optional ``memory_bytes`` and ``dtype``) looked up in the table.
    """
    if isinstance(device, DeviceDescription):
        return device.spec_score
    if isinstance(device, str):
        device = {"name": device}
    if not isinstance(device, dict):
        raise ValueError(f"device_score: expected a DeviceDescription, a dict or a device name, got "
                         f"{type(device).__name__}")
    for key in ("spec_score", "score"):
        if key in device:
            return float(device[key])
    if "name" not in device:
        raise ValueError(f"device_score: {device!r} has neither 'score' nor 'name'")
    spec = find_spec(str(device["name"]), device.get("memory_bytes"))
    if spec is None:
        raise ValueError(f"device_score: '{device['name']}' is not in the accelerator table; give its measured "
                         f"'score' (devices.measure_device_score)")
    return spec_score(spec, device.get("dtype"))


def distribute_workload(normalized_scores, train_batch_size, gradient_accumulation_steps=1):
    """Micro-batch sizes proportional to the scores (behind ``engine._distribute_workload``).

    Largest-remainder rounding of ``(train_batch_size / gas) * score_i``, each size at least 1,
    summing exactly to ``train_batch_size / gas``. Scores need not sum to 1 (they are normalised).
    """
    shares = normalize_scores(normalized_scores)
    batch = positive_int(train_batch_size, "train_batch_size")
    gas = positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
    if batch % gas or batch // gas < len(shares):
        raise ValueError(f"train_batch_size {batch} / gradient_accumulation_steps {gas} must be a whole number of "
                         f"samples per micro-step, at least one per rank ({len(shares)} ranks)")
    units = batch // gas
    quotas = [units * share for share in shares]
    sizes = [max(1, math.floor(quota)) for quota in quotas]
    missing = units - sum(sizes)
    # Floors lose less than one sample per rank, so one pass of the largest remainders fills them.
    for rank in sorted(range(len(sizes)), key=lambda rank: (sizes[rank] - quotas[rank], rank))[:max(missing, 0)]:
        sizes[rank] += 1
    # Sizes raised to the minimum of 1 can push the sum over instead: take samples back from the
    # ranks furthest above their quota.
    above = [(quotas[rank] - sizes[rank], rank) for rank in range(len(sizes)) if sizes[rank] > 1]
    heapq.heapify(above)
    for _ in range(max(-missing, 0)):
        _, rank = heapq.heappop(above)
        sizes[rank] -= 1
        if sizes[rank] > 1:
            heapq.heappush(above, (quotas[rank] - sizes[rank], rank))
    return sizes


def schedule_heterogeneous_tasks(devices, train_batch_size, gradient_accumulation_steps=1):
    """A compute_aware Plan from the devices' prior scores (behind
    ``engine.schedule_heterogeneous_tasks``).

    Args:
        devices: one entry per data-parallel rank, anything ``device_score`` accepts. If any
            device's score is unknown (0), all ranks are treated as equal until measured.
    """
    devices = list(devices)
    scores = [device_score(device) for device in devices]
    names = [d.name if isinstance(d, DeviceDescription) else d.get("name", "-") if isinstance(d, dict) else d
             for d in devices]
    unknown = [rank for rank, score in enumerate(scores) if not score > 0]
    if unknown:
        scores = [1.0] * len(devices)
    plan = plan_micro_batches(time_models_from_scores(scores), train_batch_size, gradient_accumulation_steps,
                              "compute_aware", device_names=names).with_prior_times()
    if unknown:
        plan = Plan(**{**plan.to_dict(), "notes": [f"ranks {unknown} have no known speed: equal shares until "
                                                   f"profiling measures them"]})
    return plan
