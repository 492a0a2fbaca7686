# SPDX-License-Identifier: Apache-2.0
"""Who computes how many samples: per-rank micro-batch sizes from per-rank speed (DESIGN.md 4.1).

Rank i's micro-step is modelled as ``a_i + b_i * mbs`` (a fixed cost per micro-step plus a cost
per sample), fitted from profiling steps or derived from a prior score. The planner splits the
global batch so that ``sum(mbs_i * gas_i) == train_batch_size`` exactly and the slowest rank's
predicted step time is minimal within each rank's memory limit. Pure logic: the engine gathers
the inputs and broadcasts the resulting Plan as JSON.
"""

import heapq
import math
from dataclasses import asdict, dataclass, fields
from typing import Tuple

import numpy as np

from .config import STRATEGIES
from .devices import DeviceDescription, find_spec, normalize_scores, spec_score


def _positive_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} = {value!r} must be a positive integer")
    return int(value)


@dataclass(frozen=True)
class TimeModel:
    """Predicted time of one micro-step of ``mbs`` samples on one rank: ``a + b * mbs``.

    The unit is the caller's (seconds when fitted from measurements, arbitrary for priors); only
    ratios between ranks matter to the planner.
    """

    a: float
    """Fixed cost of a micro-step (launches, hooks, per-micro-step communication); >= 0."""
    b: float
    """Cost of one sample; > 0."""

    def __post_init__(self):
        if not (isinstance(self.a, (int, float)) and math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"TimeModel: a = {self.a!r} must be a finite number >= 0")
        if not _positive_finite(self.b):
            raise ValueError(f"TimeModel: b = {self.b!r} must be a positive finite number")

    def micro_step_time(self, micro_batch_size):
        return self.a + self.b * micro_batch_size


def fit_time_model(samples):
    """Least-squares fit of ``time = a + b * mbs`` to measured micro-steps.

    Args:
        samples: (micro_batch_size, seconds) pairs. With two or more distinct sizes both a and b
            are fitted; with a single size the whole time is charged per sample (a = 0).

    A negative intercept or a non-positive slope (noise, or sizes too close together to see the
    fixed cost) falls back to the fit through the origin, ``b = sum(mbs*t) / sum(mbs^2)``: the
    planner needs time to grow with the batch, and proportional time is the safe assumption.
    """
    pairs = list(samples)
    if not pairs:
        raise ValueError("fit_time_model: no samples; give (micro_batch_size, seconds) pairs from profiling steps")
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"fit_time_model: samples[{index}] = {pair!r} is not a (micro_batch_size, seconds) pair")
        if not (_positive_finite(pair[0]) and _positive_finite(pair[1])):
            raise ValueError(f"fit_time_model: samples[{index}] = {pair!r}: the size and the time must both be "
                             f"positive finite numbers")
    sizes = [float(size) for size, _ in pairs]
    times = [float(seconds) for _, seconds in pairs]
    through_origin = TimeModel(0.0, math.fsum(m * t for m, t in zip(sizes, times)) / math.fsum(m * m for m in sizes))
    if len(set(sizes)) < 2:
        return through_origin
    mean_size, mean_time = math.fsum(sizes) / len(sizes), math.fsum(times) / len(times)
    spread = math.fsum((m - mean_size)**2 for m in sizes)
    slope = math.fsum((m - mean_size) * (t - mean_time) for m, t in zip(sizes, times)) / spread
    intercept = mean_time - slope * mean_size
    if slope <= 0 or intercept < 0:
        return through_origin
    return TimeModel(intercept, slope)


FIXED_SHARE_LIMIT = 0.5
"""A fitted fixed cost above this share of the micro-step it was measured at is taken as noise."""


def plausible_time_model(model, size):
    """``model``, or the proportional model through its time at ``size`` when its fixed cost is
    more than ``FIXED_SHARE_LIMIT`` of that time.

    A few steps at sizes close together, on a loaded machine, leave the split between fixed and
    per-sample cost to noise: a fit can come out nearly flat (``a`` large, ``b`` small). Used far
    from the sizes it was measured at, such a model makes a rank look cheap per sample, or makes
    moving work off a slowed rank look useless. Proportional time is the safe side: it keeps the
    measured point and lets work follow speed.
    """
    if not size or model.a <= FIXED_SHARE_LIMIT * model.micro_step_time(size):
        return model
    return TimeModel(0.0, model.micro_step_time(size) / size)


def time_models_from_scores(scores):
    """Prior time models from relative speed scores (e.g. TFLOP/s): ``b_i = 1 / score_i``, ``a_i = 0``."""
    scores = list(scores)
    for index, score in enumerate(scores):
        if not _positive_finite(score):
            raise ValueError(f"time_models_from_scores: scores[{index}] = {score!r} must be a positive finite number")
    return [TimeModel(0.0, 1.0 / score) for score in scores]


@dataclass(frozen=True)
class Plan:
    """Per-data-parallel-rank work of one optimizer step; broadcast between ranks as ``to_dict()``."""

    micro_batch_sizes: Tuple[int, ...]
    gradient_accumulation_steps: Tuple[int, ...]
    """Equal on every rank unless per-rank accumulation was allowed and memory made it pay."""
    train_batch_size: int
    strategy: str
    predicted_rank_times: Tuple[float, ...]
    """gas_i * (a_i + b_i * mbs_i) per rank, in the time models' unit."""
    notes: Tuple[str, ...] = ()
    """Remarks for the log: memory limits a fixed plan exceeds, per-rank accumulation in use."""

    def __post_init__(self):
        for name in ("micro_batch_sizes", "gradient_accumulation_steps", "predicted_rank_times", "notes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        sizes, steps = self.micro_batch_sizes, self.gradient_accumulation_steps
        if not sizes or len(steps) != len(sizes) or len(self.predicted_rank_times) != len(sizes):
            raise ValueError(f"Plan: micro_batch_sizes ({len(sizes)}), gradient_accumulation_steps ({len(steps)}) and "
                             f"predicted_rank_times ({len(self.predicted_rank_times)}) need one entry per rank")
        for rank, (size, gas) in enumerate(zip(sizes, steps)):
            _positive_int(size, f"Plan: micro_batch_sizes[{rank}]")
            _positive_int(gas, f"Plan: gradient_accumulation_steps[{rank}]")
        if sum(self.samples_per_rank) != self.train_batch_size:
            raise ValueError(f"Plan: sum(mbs_i * gas_i) = {sum(self.samples_per_rank)} differs from train_batch_size "
                             f"{self.train_batch_size}")

    @property
    def world_size(self):
        return len(self.micro_batch_sizes)

    @property
    def samples_per_rank(self):
        """Samples each rank computes per optimizer step: mbs_i * gas_i."""
        return tuple(m * g for m, g in zip(self.micro_batch_sizes, self.gradient_accumulation_steps))

    @property
    def predicted_step_time(self):
        """The slowest rank's predicted time for one optimizer step."""
        return max(self.predicted_rank_times)

    @property
    def loss_weights(self):
        """w_i = W * mbs_i * gas_i / train_batch_size (W * mbs_i / sum(mbs) when gas is equal).

        Applied to rank i's loss before the engine's 1/gas_i scaling, it turns the reducers' mean
        over ranks into the mean over the global batch.
        """
        return tuple(self.world_size * n / self.train_batch_size for n in self.samples_per_rank)

    @property
    def per_rank_gas(self):
        return len(set(self.gradient_accumulation_steps)) > 1

    def to_dict(self):
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, values):
        expected = {f.name for f in fields(cls)}
        missing, unknown = expected - set(values) - {"notes"}, set(values) - expected
        if missing or unknown:
            raise ValueError(f"Plan.from_dict: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
        return cls(**values)

    def format_table(self, device_names=None):
        """The plan as a printable table: rank, device, mbs, gas, samples/step, predicted time, share."""
        names = ["-"] * self.world_size if device_names is None else [str(name) for name in device_names]
        if len(names) != self.world_size:
            raise ValueError(f"format_table: {len(names)} device names for {self.world_size} ranks")
        batch = self.train_batch_size
        header = ("rank", "device", "mbs", "gas", "samples/step", "pred. time", "share")
        rows = [(str(rank), names[rank], str(m), str(g), str(m * g), f"{t:.4g}", f"{100 * m * g / batch:.1f}%")
                for rank, (m, g, t) in enumerate(zip(self.micro_batch_sizes, self.gradient_accumulation_steps,
                                                     self.predicted_rank_times))]
        widths = [max(len(row[column]) for row in [header] + rows) for column in range(len(header))]
        lines = ["  ".join(cell.ljust(width) if column == 1 else cell.rjust(width)
                           for column, (cell, width) in enumerate(zip(row, widths))) for row in [header] + rows]
        mean_time = math.fsum(self.predicted_rank_times) / self.world_size
        lines.append(f"strategy {self.strategy}, train_batch_size {self.train_batch_size}, predicted step time "
                     f"{self.predicted_step_time:.4g}, balance (mean/max rank time) "
                     f"{100 * mean_time / self.predicted_step_time:.1f}%")
        return "\n".join(lines + [f"note: {note}" for note in self.notes])


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
    (``sum(mbs_i * gas_i) == train_batch_size``; see ``_per_rank_gas_plan`` for the rule); that
    plan is used only when it is predicted faster than the equal-gas one, or when no equal-gas plan
    fits in memory.

    Returns:
        Plan. Raises ValueError saying what is wrong and what would work.
    """
    models = list(time_models)
    if not models or not all(isinstance(model, TimeModel) for model in models):
        raise ValueError("plan_micro_batches: time_models must be a non-empty list of TimeModel, one per rank")
    world = len(models)
    batch = _positive_int(train_batch_size, "train_batch_size")
    gas = _positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
    if batch % gas:
        raise ValueError(f"train_batch_size {batch} is not divisible by gradient_accumulation_steps {gas}: every "
                         f"micro-step must hold a whole number of samples")
    per_micro_step = batch // gas
    if per_micro_step < world:
        raise ValueError(f"train_batch_size {batch} / gradient_accumulation_steps {gas} = {per_micro_step} samples per "
                         f"micro-step cannot give each of the {world} data-parallel ranks at least one sample")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if manual is not None and strategy != "manual":
        raise ValueError(f"manual micro-batch sizes are used only by strategy 'manual' (got '{strategy}')")
    names = None if device_names is None else [str(name) for name in device_names]
    if names is not None and len(names) != world:
        raise ValueError(f"device_names has {len(names)} entries for {world} data-parallel ranks")
    caps = _memory_caps(max_micro_batch, world, names)

    if strategy == "uniform":
        if per_micro_step % world:
            raise ValueError(_uniform_error(batch, gas, world))
        return _fixed_plan(models, [per_micro_step // world] * world, gas, batch, strategy, caps)
    if strategy == "manual":
        return _fixed_plan(models, _manual_sizes(manual, world, names, batch, gas), gas, batch, strategy, caps)
    return _compute_aware(models, batch, gas, caps, allow_per_rank_gas)


def device_score(device):
    """Prior speed of one device in TFLOP/s: the seed's ``engine._get_device_score(dev)``.

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
    """Micro-batch sizes proportional to the scores: the seed's ``engine._distribute_workload``.

    Largest-remainder rounding of ``(train_batch_size / gas) * score_i``, each size at least 1,
    summing exactly to ``train_batch_size / gas``. Scores need not sum to 1 (they are normalised).
    """
    shares = normalize_scores(normalized_scores)
    batch = _positive_int(train_batch_size, "train_batch_size")
    gas = _positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
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
    """A compute_aware Plan from the devices' prior scores: the seed's ``engine.schedule_heterogeneous_tasks``.

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
                              "compute_aware", device_names=names)
    if unknown:
        plan = Plan(**{**plan.to_dict(), "notes": [f"ranks {unknown} have no known speed: equal shares until "
                                                   f"profiling measures them"]})
    return plan


def _rank_label(rank, names):
    return f"rank {rank} ({names[rank]})" if names else f"rank {rank}"


def _memory_caps(max_micro_batch, world, names):
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


def _uniform_error(batch, gas, world):
    unit = gas * world
    lower, higher = batch // unit * unit, (batch // unit + 1) * unit
    works = f"{lower} or {higher}" if lower else f"{higher}"
    return (f"strategy 'uniform' splits each micro-step's train_batch_size / gradient_accumulation_steps = "
            f"{batch} / {gas} = {batch // gas} samples equally, which the {world} data-parallel ranks do not "
            f"divide; train_batch_size values that work: {works} (multiples of gas * world size = {unit}), or use "
            f"strategy 'compute_aware' or 'manual'")


def _manual_sizes(manual, world, names, batch, gas):
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
        _positive_int(size, f"manual {where(rank)}")
    total = sum(sizes)
    if total * gas != batch:
        raise ValueError(f"manual micro_batch_sizes sum to {total} per micro-step, so {total} * "
                         f"gradient_accumulation_steps {gas} = {total * gas} samples per step, but train_batch_size "
                         f"is {batch}: the sizes must sum to {batch} / {gas} = {batch // gas}")
    return [int(size) for size in sizes]


def _fixed_plan(models, sizes, gas, batch, strategy, caps):
    notes = tuple(f"rank {rank}: micro-batch {size} exceeds its predicted memory limit of {cap} samples"
                  for rank, (size, cap) in enumerate(zip(sizes, caps)) if cap is not None and size > cap)
    return _plan(models, batch, gas, sizes, [1] * len(sizes), strategy, notes)


def _plan(models, batch, gas, sizes, multiples, strategy="compute_aware", notes=()):
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


def _compute_aware(models, batch, gas, caps, allow_per_rank_gas):
    world, units = len(models), batch // gas
    bounded = [units if cap is None else min(cap, units) for cap in caps]
    equal = None
    if sum(bounded) >= units:
        equal = _plan(models, batch, gas, _balance(models, units, bounded, [1] * world), [1] * world)
    splits = _per_rank_gas_splits(models, units, bounded) if allow_per_rank_gas else []
    if splits:
        best = min((_plan(models, batch, gas, sizes, multiples) for sizes, multiples in splits),
                   key=lambda plan: plan.predicted_step_time)
        if equal is None or best.predicted_step_time < equal.predicted_step_time * (1 - 1e-9):
            more = [rank for rank, steps in enumerate(best.gradient_accumulation_steps) if steps > gas]
            shown = ", ".join(map(str, more[:8])) + (f", ... ({len(more)} ranks)" if len(more) > 8 else "")
            return Plan(**{**best.to_dict(), "notes": [f"per-rank gradient accumulation: ranks {shown} run more "
                                                       f"micro-steps because memory caps their micro-batch"]})
    if equal is None:
        raise ValueError(_capacity_error(batch, gas, world, bounded))
    return equal


# Integer splitting. A rank's sizes 1, 2, 3, ... are "slots" with increasing costs; the best
# split takes the cheapest slots. Everything below works on lists indexed by rank.


def _bisect(holdings, weights, units, high, spacing):
    """Sizes just below and just above the cheapest way to hold ``units``.

    ``holdings(T)`` gives every rank's largest size whose cost is at most T (at least 1).
    Bisection stops once the bracket is narrower than ``spacing``, the smallest cost of one more
    slot, so at most one slot per rank lies between its ends. Returns (sizes at the low end: less
    than ``units``, or all ones; sizes at the high end: at least ``units``).
    """
    low = 0.0
    if int(holdings(low) @ weights) >= units:
        high = low
    while high - low > spacing:
        middle = (low + high) / 2
        if not low < middle < high:
            break  # adjacent floats: the spacing is below their resolution
        if int(holdings(middle) @ weights) >= units:
            high = middle
        else:
            low = middle
    return holdings(low).tolist(), holdings(high).tolist()


def _adjust(cost, sizes, caps, steps, remaining, direction):
    """Move ``remaining`` samples by growing (+1: cheapest next slot first, ties to the lower rank)
    or shrinking (-1: most expensive slot first, ties to the higher rank) one slot at a time.
    ``cost(rank, size)`` is the cost of holding ``size``. Returns (sizes, samples that no slot could
    move without overshooting)."""
    sizes = list(sizes)

    def key(rank):
        price = cost(rank, sizes[rank] + (direction > 0))
        return (price, rank) if direction > 0 else (-price, -rank)

    movable = lambda rank: 1 <= sizes[rank] + direction <= caps[rank]
    heap = [key(rank) for rank in range(len(sizes)) if movable(rank)]
    heapq.heapify(heap)
    while remaining and heap:
        rank = abs(heapq.heappop(heap)[1])
        if steps[rank] > remaining:
            continue  # a whole slot here would overshoot; finer steps may still fit
        sizes[rank] += direction
        remaining -= steps[rank]
        if movable(rank):
            heapq.heappush(heap, key(rank))
    return sizes, remaining


def _exact(cost, bracket, caps, steps, units):
    """From the high end of the bracket give back the most expensive slots; if coarse steps get
    stuck above ``units``, fill the low end with the cheapest slots instead. None if neither lands."""
    below, above = bracket
    surplus = lambda sizes: sum(m * k for m, k in zip(sizes, steps)) - units
    if surplus(above) >= 0:
        sizes, left = _adjust(cost, above, caps, steps, surplus(above), -1)
        if not left:
            return sizes
    if surplus(below) <= 0:
        sizes, left = _adjust(cost, below, caps, steps, -surplus(below), +1)
        if not left:
            return sizes
    return None


def _linear_bracket(models, units, caps, steps):
    """``_bisect`` for costs ``steps_i * (a_i + b_i * m)``; returns (bracket, cost)."""
    a = np.array([model.a for model in models])
    b = np.array([model.b for model in models])
    k = np.array(steps, dtype=np.float64)
    cap = np.array(caps, dtype=np.float64)

    def holdings(limit):
        m = np.floor((limit / k - a) / b)
        # The float quotient can be off by one either way; settle on the rule t_i(m) <= limit itself,
        # computed as TimeModel computes it so that the bracket and the heap agree on ties.
        m += k * (a + b * (m + 1)) <= limit
        m -= k * (a + b * m) > limit
        return np.clip(m, 1, cap).astype(np.int64)

    bracket = _bisect(holdings, np.array(steps, dtype=np.int64), units, float(np.max(k * (a + b * cap))),
                      float(np.min(k * b)))
    return bracket, lambda rank, size: steps[rank] * models[rank].micro_step_time(size)


def _balance(models, units, caps, steps):
    """Integer ``m_i`` in ``[1, caps[i]]`` minimising the slowest ``steps_i * (a_i + b_i * m_i)`` subject
    to ``sum(steps_i * m_i) == units``; None when the steps cannot meet ``units`` exactly.

    Rank i's sizes 2, 3, ... are slots costing ``t_i(m)`` and worth ``steps_i`` samples; the best
    split takes the cheapest slots. With all steps 1 the give-back lands exactly on them: the split
    is optimal, and ties go to the lower rank, so every rank computes the same plan. Needs
    ``sum(steps) <= units <= sum(steps * caps)``.
    """
    bracket, cost = _linear_bracket(models, units, caps, steps)
    return _exact(cost, bracket, caps, steps, units)


def _shares_with_fewest_micro_steps(models, units, caps):
    """Samples per step n_i balancing ``ceil(n_i / caps[i]) * a_i + b_i * n_i``: each rank's time when
    it runs the fewest micro-steps that fit its memory (micro-batch sizes left to round later)."""
    a = np.array([model.a for model in models])
    b = np.array([model.b for model in models])
    cap = np.array(caps, dtype=np.float64)

    def holdings(limit):
        # Full micro-batches that fit in the limit, then as much of one more micro-step as fits.
        full = np.floor(limit / (a + b * cap))
        full += (full + 1) * a + b * ((full + 1) * cap) <= limit
        full -= full * a + b * (full * cap) > limit
        partial = np.floor((limit - (full + 1) * a) / b)
        partial += (full + 1) * a + b * (partial + 1) <= limit
        partial -= (full + 1) * a + b * partial > limit
        return np.clip(np.maximum(full * cap, np.minimum(partial, (full + 1) * cap)), 1, units).astype(np.int64)

    def cost(rank, share):
        return -(-share // caps[rank]) * models[rank].a + models[rank].b * share

    world = len(models)
    bracket = _bisect(holdings, np.ones(world, dtype=np.int64), units, max(cost(r, units) for r in range(world)),
                      float(np.min(b)))
    return _exact(cost, bracket, [units] * world, [1] * world, units)


def _fewest_micro_steps(units, cap):
    """The smallest divisor g of ``units`` with ``units / g <= cap``: fewest micro-steps that fit."""
    need, best = -(-units // cap), units
    for divisor in range(1, math.isqrt(units) + 1):
        if units % divisor == 0:
            for candidate in (divisor, units // divisor):
                if need <= candidate < best:
                    best = candidate
    return best


def _per_rank_gas_splits(models, units, caps):
    """Candidate (sizes, multiples) in which rank i runs ``multiples[i]`` micro-steps of
    ``sizes[i]`` samples; empty when every rank's share fits its memory in one micro-step.

    Rule: the samples per step n_i are balanced as if each rank ran the fewest micro-steps its
    memory allows, ``ceil(n_i / caps[i])`` (1 where the share fits, so those ranks keep the
    configured gas). Whole micro-batches are then made in two ways, and the caller keeps the
    faster: factor every n_i into the fewest micro-steps that divide it; or fix
    ``k_i = ceil(n_i / caps[i])`` and balance the sizes again (when whole micro-steps cannot meet
    the batch, the rank whose time ends up lowest takes the difference).
    """
    shares = _shares_with_fewest_micro_steps(models, units, caps)
    if all(share <= cap for share, cap in zip(shares, caps)):
        return []
    factored = [_fewest_micro_steps(share, cap) for share, cap in zip(shares, caps)]
    multiples = [-(-share // cap) for share, cap in zip(shares, caps)]
    sizes = _balance(models, units, caps, multiples)
    if sizes is None:
        sizes, multiples = _place_remainder(models, units, caps, multiples)
    return [([n // k for n, k in zip(shares, factored)], factored), (sizes, multiples)]


def _place_remainder(models, units, caps, multiples):
    """Sizes for fixed multiples filled to just under ``units``; one rank then takes the rest with
    the fewest micro-steps that fit its memory: the rank whose time ends up lowest."""
    (below, _), cost = _linear_bracket(models, units, caps, multiples)
    missing = units - sum(m * k for m, k in zip(below, multiples))
    sizes, missing = _adjust(cost, below, caps, multiples, missing, +1)
    options = []
    for rank, model in enumerate(models):
        share = multiples[rank] * sizes[rank] + missing
        steps = _fewest_micro_steps(share, caps[rank])
        options.append((steps * model.micro_step_time(share // steps), rank, steps, share // steps))
    _, rank, steps, size = min(options)
    sizes, multiples = list(sizes), list(multiples)
    sizes[rank], multiples[rank] = size, steps
    return sizes, multiples
