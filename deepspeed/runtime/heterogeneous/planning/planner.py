# SPDX-License-Identifier: Apache-2.0
"""Who computes how many samples: per-rank micro-batch sizes from per-rank speed (docs/balancing.md, "Strategies").

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
- ``strategies.py``: the registered strategies (uniform, manual, compute_aware, one's own);
- ``allocation.py``: the rules of the built-in ones;
- ``integer_split.py``: the exact integer min-max split the compute_aware rule uses.
"""

from .allocation import memory_caps
from ..measure.devices import DeviceDescription, find_spec, normalize_scores, spec_score
from .plan import Plan, positive_int
from .strategies import COMPUTE_AWARE, PlanRequest, get_strategy, strategy_names
from .time_model import FIXED_SHARE_LIMIT, TimeModel, fit_time_model, plausible_time_model, time_models_from_scores

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
                       strategy=COMPUTE_AWARE,
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
        strategy: the name of a registered strategy (``strategies.py``): "uniform" (equal split),
            "compute_aware" (minimise the slowest rank's predicted time; default), "manual" (sizes
            from ``manual``) or one of one's own.
        max_micro_batch: per-rank memory limits in samples per micro-step (None entries: no limit).
            Default None: no limits. compute_aware respects them; a fixed (uniform/manual) plan
            that exceeds one gets a note.
        manual: for a strategy that takes sizes ("manual"), a list of sizes per rank or a map
            device name -> size.
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
    rule = get_strategy(strategy)
    if manual is not None and not rule.takes_sizes:
        raise ValueError(f"micro-batch sizes are not read by strategy '{strategy}'; strategies that read them: "
                         f"{', '.join(_taking_sizes())}")
    names = None if device_names is None else [str(name) for name in device_names]
    if names is not None and len(names) != world:
        raise ValueError(f"device_names has {len(names)} entries for {world} data-parallel ranks")
    caps = memory_caps(max_micro_batch, world, names)

    plan = rule.plan(PlanRequest(models, batch, gas, caps, names, manual, bool(allow_per_rank_gas), strategy))
    _check_plan(plan, strategy, world, gas, bool(allow_per_rank_gas))
    return plan


def _taking_sizes():
    return [name for name in strategy_names() if get_strategy(name).takes_sizes]


def _check_plan(plan, strategy, world, gas, allow_per_rank_gas):
    """A strategy's plan must cover every rank (a ``Plan`` already sums to its global batch), and
    may give ranks different gas only where allowed: with ZeRO-2/3 every micro-step reduces, so
    ranks running different numbers of them would wait in each other's collectives."""
    if not isinstance(plan, Plan):
        raise TypeError(f"strategy '{strategy}' returned {type(plan).__name__}, not a Plan (use request.fixed_plan)")
    if plan.world_size != world:
        raise ValueError(f"strategy '{strategy}' planned {plan.world_size} ranks' micro-batches "
                         f"{list(plan.micro_batch_sizes)} for {world} data-parallel ranks")
    steps = set(plan.gradient_accumulation_steps)
    if steps != {gas} and not (allow_per_rank_gas and all(g % gas == 0 for g in steps)):
        allowed = (f"multiples of {gas} per rank (per-rank gas is allowed here)" if allow_per_rank_gas else
                   f"{gas} on every rank (per-rank gas is allowed only with ZeRO-0/1)")
        raise ValueError(f"strategy '{strategy}' planned gradient_accumulation_steps "
                         f"{list(plan.gradient_accumulation_steps)}; allowed: {allowed}")


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
    """Micro-batch sizes for ranks of the given relative speeds (behind ``engine._distribute_workload``):
    the compute_aware split of ``train_batch_size / gas`` samples per micro-step with a rank's time
    per sample ``1 / score``, each rank at least one sample. Scores need not sum to 1."""
    shares = normalize_scores(normalized_scores)
    batch = positive_int(train_batch_size, "train_batch_size")
    gas = positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
    if batch % gas or batch // gas < len(shares):
        raise ValueError(f"train_batch_size {batch} / gradient_accumulation_steps {gas} must be a whole number of "
                         f"samples per micro-step, at least one per rank ({len(shares)} ranks)")
    return list(plan_micro_batches(time_models_from_scores(shares), batch, gas, COMPUTE_AWARE).micro_batch_sizes)


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
                              COMPUTE_AWARE, device_names=names).with_prior_times()
    if unknown:
        plan = Plan(**{**plan.to_dict(), "notes": [f"ranks {unknown} have no known speed: equal shares until "
                                                   f"profiling measures them"]})
    return plan
