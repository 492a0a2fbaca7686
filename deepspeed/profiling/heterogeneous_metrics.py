# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler's metrics (docs/profiler.md): pure functions over plain records.

``HeterogeneousProfiler`` (``heterogeneous_profiler.py``) gathers the records; everything here is
computed the same on every rank from them, without processes or a device.

Definitions (sums run over the profiled steps; ``N`` data-parallel ranks):

- ``busy_{i,s} = compute_s + optimizer_s``: what rank ``i`` itself computed in step ``s``;
  ``compute_s = forward_s + backward_s`` when the step ran through ``engine.backward()`` (a
  torch-style ``loss.backward()`` leaves them one span, counted as forward).
- Step time ``T_s = max_i wall_s``: a step is over when its slowest rank is; every share below
  is relative to ``sum_s T_s``, so the shares of one rank add up to at most 1.
- Compute utilisation of rank ``i``: ``sum_s busy_{i,s} / sum_s T_s``
  (``get_device_utilization()`` returns it per rank, in rank order).
- Heterogeneous resource utilisation: ``sum_{i,s} busy_{i,s} / (N * sum_s T_s)``, the share of
  the cluster's device time spent computing (the mean of the ranks' utilisations).
- Transfer and waiting: every rank of a step goes through the same collectives, and the last
  rank to arrive hardly waits, so the data movement of step ``s`` is estimated as
  ``transfer_s = min_i collective_{i,s}`` and rank ``i`` waited
  ``waiting_{i,s} = collective_{i,s} - transfer_s``. A rank's transfer and waiting shares are
  their sums over ``sum_s T_s``; its communication share is their sum. Overall shares are the
  means over ranks.
- Peak memory of a rank: on the CPU accelerator the predicted model-state bytes of its ZeRO shard
  plus the largest activation bytes of one micro-step; on other accelerators the device's
  ``max_memory_allocated()`` since ``start_heterogeneous_profile()`` (which resets the peak).
- Memory utilisation of a rank: peak / capacity (the device's or the emulated memory), None when
  the capacity is unknown (the CPU accelerator without emulation).
- Memory balance: ``min / max`` of the ranks' memory utilisations when every capacity is known,
  else of their peaks; 1.0 means every rank is equally full.
- Throughput: ``sum_{i,s} samples_{i,s} / sum_s T_s`` samples/s (the global batch over the mean
  step time).
- Health targets: utilisation > 75% (else LOW), communication share < 25% (else
  HIGH), memory balance > 0.8 (else LOW); ``n/a`` when a value is unknown.
- Speed changes: a rank's compute seconds per sample (``busy / samples``) that moves by a factor
  of ``SPEED_CHANGE_FACTOR`` or more between two runs of at least ``SPEED_CHANGE_MIN_STEPS`` steps
  at one micro-batch size (medians), and the changes an emulation's ``speed_schedule`` asked for
  within the window; one entry per rank and change, the asked and the measured side by side when
  they are within a step.
"""

import itertools
import math

from deepspeed.runtime.heterogeneous.cluster.agreement import merge_replicas as merge_model_parallel_peers

__all__ = ["HEALTH_TARGETS", "METRICS_VERSION", "compute_metrics", "health_status", "measured_speed_changes",
           "memory_balance", "merge_replicas", "speed_changes", "split_collective_time"]

METRICS_VERSION = 1

HEALTH_TARGETS = {
    # name: (target, True when the value must be above it)
    "utilization": (0.75, True),
    "communication_share": (0.25, False),
    "memory_balance": (0.8, True),
}

SPEED_CHANGE_FACTOR = 1.5
SPEED_CHANGE_MIN_STEPS = 3

_RECORD_FIELDS = ("compute_s", "forward_s", "backward_s", "optimizer_s", "collective_s", "wall_s", "activation_bytes",
                  "resplit_input_bytes", "resplit_output_bytes")


def health_status(name, value):
    """'ok', 'LOW' or 'HIGH' for ``value`` against the health target ``name``; 'n/a' for None."""
    target, above = HEALTH_TARGETS[name]
    if value is None:
        return "n/a"
    if above:
        return "ok" if value > target else "LOW"
    return "ok" if value < target else "HIGH"


def split_collective_time(collective_seconds):
    """(transfer, per-rank waiting) of one step from each rank's seconds inside collectives."""
    transfer = min(collective_seconds)
    return transfer, [seconds - transfer for seconds in collective_seconds]


def memory_balance(peaks, capacities=None):
    """min / max of the per-rank memory utilisations when every capacity is known, else of the
    peaks; None when a peak is unknown or every one is 0."""
    if any(peak is None for peak in peaks):
        return None
    if capacities is not None and all(capacity for capacity in capacities):
        values = [peak / capacity for peak, capacity in zip(peaks, capacities)]
    else:
        values = list(peaks)
    highest = max(values)
    return min(values) / highest if highest > 0 else None


def merge_replicas(contributions, data_parallel_size):
    """One entry per data-parallel rank from every process's ``{"dp_rank", "records", "peak_bytes"}``.

    Model-parallel members of one replica ran the same steps; a step counts at its slowest member's
    times and largest activation bytes, and the replica's peak is its largest member's (the
    runtime's ``agreement.merge_replicas``, which pools the plan's measurements the same way)."""

    def slowest_member(steps, rank):
        record = dict(steps[0])
        for field in _RECORD_FIELDS:
            values = [step[field] for step in steps if step.get(field) is not None]
            record[field] = max(values) if values else None
        return record

    fields = [{"dp_rank": c["dp_rank"], "records": c["records"], "peak_bytes": c.get("peak_bytes")}
              for c in contributions]
    return merge_model_parallel_peers(fields, data_parallel_size, {"records": slowest_member})


def _ratio(numerator, denominator):
    return numerator / denominator if denominator > 0 else 0.0


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _deviation(values):
    centre = _median(values)
    return math.fsum(abs(value - centre) for value in values)


def _level_shifts(levels, start, stop, threshold, min_steps):
    """Where ``levels[start:stop]`` shifts by ``threshold`` or more: the split that leaves the least
    absolute deviation from each side's median, then the same within each side. Medians and
    absolute deviations, so one slow step (a neighbour's burst, a garbage collection) is no shift."""
    splits = range(start + min_steps, stop - min_steps + 1)
    if not splits:
        return []
    split = min(splits, key=lambda at: _deviation(levels[start:at]) + _deviation(levels[at:stop]))
    before, after = _median(levels[start:split]), _median(levels[split:stop])
    if abs(after - before) < threshold:
        return []
    # The steps either side of the split belong to their sides; else the shift lies elsewhere (a
    # burst of min_steps - 1 slow steps at the end of a run pulls the split onto a normal step).
    if abs(levels[split] - after) > abs(levels[split] - before) or \
            abs(levels[split - 1] - before) > abs(levels[split - 1] - after):
        return []
    return (_level_shifts(levels, start, split, threshold, min_steps) + [split] +
            _level_shifts(levels, split, stop, threshold, min_steps))


def measured_speed_changes(steps, per_rank_records, factor=SPEED_CHANGE_FACTOR, min_steps=SPEED_CHANGE_MIN_STEPS):
    """Steps at which a rank's compute seconds per sample moved by ``factor`` or more and stayed.

    Only steps at one micro-batch size are compared: a rebalance changes the size, and with it the
    share of a micro-step's fixed cost in each sample (on the small GPT on a CPU, 12 samples cost
    half as much each as 8), which is no change of the device's speed.

    Args:
        steps: the profiled steps, in order.
        per_rank_records: per rank, its records of those steps (``compute_s``, ``optimizer_s``,
            ``samples``, ``micro_batch_size``).
        factor: the smallest ratio of the medians either side that counts (default 1.5).
        min_steps: the fewest steps either side of a change (default 3).

    Returns ``[{"step", "rank", "seconds_per_sample": [before, after], "factor": after / before}]``,
    ``step`` the first step at the new speed; a factor above 1 is a slow-down.
    """
    changes = []
    for rank, records in enumerate(per_rank_records):
        timed = [(step, r["micro_batch_size"], (r["compute_s"] + r["optimizer_s"]) / r["samples"])
                 for step, r in zip(steps, records) if r["samples"] > 0 and r["compute_s"] + r["optimizer_s"] > 0]
        for _, run in itertools.groupby(timed, key=lambda entry: entry[1]):
            run = list(run)
            # On log values a slow-down and a speed-up by the same factor are shifts of one size.
            levels = [math.log(seconds) for _, _, seconds in run]
            bounds = [0] + _level_shifts(levels, 0, len(levels), math.log(factor), min_steps) + [len(levels)]
            for before, at, after in zip(bounds, bounds[1:], bounds[2:]):
                per_sample = [math.exp(_median(levels[before:at])), math.exp(_median(levels[at:after]))]
                changes.append({"step": run[at][0], "rank": rank, "seconds_per_sample": per_sample,
                                "factor": per_sample[1] / per_sample[0]})
    return changes


def asked_speed_changes(steps, emulation, world_size):
    """The changes of the emulated speeds that ``emulation`` (``{"speeds", "speed_schedule"}``, one
    speed per data-parallel rank) makes at the profiled ``steps``: ``[{"step", "rank", "speeds":
    [before, after]}]``; none without emulation or where the lists are not one entry per rank."""
    if not emulation:
        return []
    first = emulation.get("speeds") or [1.0] * world_size
    schedule = sorted(emulation.get("speed_schedule") or [], key=lambda change: change["step"])
    if len(first) != world_size or any(len(change["speeds"]) != world_size for change in schedule):
        return []

    def speeds_at(step):
        due = [change["speeds"] for change in schedule if change["step"] <= step]
        return list(due[-1]) if due else list(first)

    return [{"step": step, "rank": rank, "speeds": [before[rank], after[rank]]}
            for step in steps for before, after in [(speeds_at(step - 1), speeds_at(step))]
            for rank in range(world_size) if before[rank] != after[rank]]


def speed_changes(steps, per_rank_records, emulation=None):
    """Each rank's speed changes within the profiled steps: asked by the emulation, measured, or
    both (a measured change within one step of an asked one for the same rank is that change).

    Returns ``[{"step", "rank", "asked_speeds": [before, after] or None, "measured_factor": float
    or None, "seconds_per_sample": [before, after] or None}]`` sorted by step and rank."""
    measured = measured_speed_changes(steps, per_rank_records)
    merged = []
    for asked in asked_speed_changes(steps, emulation, len(per_rank_records)):
        match = next((m for m in measured if m["rank"] == asked["rank"] and abs(m["step"] - asked["step"]) <= 1),
                     None)
        if match is not None:
            measured.remove(match)
        merged.append({"step": asked["step"], "rank": asked["rank"], "asked_speeds": asked["speeds"],
                       "measured_factor": match and match["factor"],
                       "seconds_per_sample": match and match["seconds_per_sample"]})
    merged += [{"step": m["step"], "rank": m["rank"], "asked_speeds": None, "measured_factor": m["factor"],
                "seconds_per_sample": m["seconds_per_sample"]} for m in measured]
    return sorted(merged, key=lambda change: (change["step"], change["rank"]))


def compute_metrics(ranks, capacities=None, plan=None, device_names=None, events=(), topology=None,
                    emulation=None):
    """The profile's metrics (a JSON-ready dict) from per-rank records (see the module docstring).

    Args:
        ranks: one ``{"records": [...], "peak_bytes": int or None}`` per data-parallel rank, in rank
            order; records as the runtime writes them, the same steps on every rank.
        capacities: per-rank memory capacity in bytes (entries may be None), or None.
        plan: the plan in force as ``Plan.to_dict()``, or None.
        device_names: per-rank device names, or None.
        events: rebalance events as dicts (``step``, ``old_sizes``, ``new_sizes``, ...).
        topology: the hosts and measured inter-host bandwidths (``Topology.to_dict()`` plus its
            one-line ``describe``), or None on one host.
        emulation: the emulated speeds, ``{"speeds": [...] or None, "speed_schedule": [{"step",
            "speeds"}, ...]}``, one speed per data-parallel rank, or None: their changes within the
            window join the measured ones in ``speed_changes``.
    """
    if not ranks:
        raise ValueError("HeterogeneousProfiler: no ranks to compute metrics for")
    world = len(ranks)
    steps = [record["step"] for record in ranks[0]["records"]]
    for rank, entry in enumerate(ranks):
        if [record["step"] for record in entry["records"]] != steps:
            raise ValueError(f"HeterogeneousProfiler: rank {rank} recorded steps "
                             f"{[r['step'] for r in entry['records']]}, rank 0 {steps}; call "
                             f"start_heterogeneous_profile() and stop_profile() on every rank at the same step")
    if not steps:
        raise ValueError("HeterogeneousProfiler: no optimizer step finished between start_heterogeneous_profile() "
                         "and stop_profile(); train at least one step in between")
    by_step = list(zip(*(entry["records"] for entry in ranks)))  # by_step[s][i]
    step_times = [max(record["wall_s"] for record in step) for step in by_step]
    transfers, waits = zip(*(split_collective_time([r["collective_s"] for r in step]) for step in by_step))
    total_time = math.fsum(step_times)
    capacities = list(capacities) if capacities is not None else [None] * world
    names = list(device_names) if device_names is not None else ["-"] * world
    rank_metrics = []
    for rank, entry in enumerate(ranks):
        records = entry["records"]
        busy = [r["compute_s"] + r["optimizer_s"] for r in records]
        waiting = [wait[rank] for wait in waits]
        utilization = _ratio(math.fsum(busy), total_time)
        transfer_share = _ratio(math.fsum(transfers), total_time)
        waiting_share = _ratio(math.fsum(waiting), total_time)
        peak, capacity = entry["peak_bytes"], capacities[rank]
        memory_utilization = peak / capacity if peak is not None and capacity else None
        rank_metrics.append({
            "rank": rank,
            "device": str(names[rank]),
            "micro_batch_sizes": sorted({r["micro_batch_size"] for r in records}),
            "samples_per_step": math.fsum(r["samples"] for r in records) / len(records),
            "busy_s_per_step": math.fsum(busy) / len(records),
            "forward_s_per_step": math.fsum(r.get("forward_s") or 0.0 for r in records) / len(records),
            "backward_s_per_step": math.fsum(r.get("backward_s") or 0.0 for r in records) / len(records),
            "optimizer_s_per_step": math.fsum(r["optimizer_s"] for r in records) / len(records),
            "compute_utilization": utilization,
            "communication_share": transfer_share + waiting_share,
            "transfer_share": transfer_share,
            "waiting_share": waiting_share,
            "peak_memory_bytes": peak,
            "memory_capacity_bytes": capacity,
            "memory_utilization": memory_utilization,
            "health": {
                "utilization": health_status("utilization", utilization),
                "communication_share": health_status("communication_share", transfer_share + waiting_share),
            },
            "timeline": [{
                "step": r["step"],
                "busy_s": b,
                "waiting_s": w,
                "transfer_s": t,
                "wall_s": r["wall_s"]
            } for r, b, w, t in zip(records, busy, waiting, transfers)],
        })
    utilization = math.fsum(r["compute_utilization"] for r in rank_metrics) / world
    communication = math.fsum(r["communication_share"] for r in rank_metrics) / world
    # Each step's share: its time in collectives (the transfer and the waits, the ranks' mean) over
    # the step; the window's share above is the same sum over the window's time.
    step_shares = [_ratio(transfer + math.fsum(wait) / world, step_time)
                   for transfer, wait, step_time in zip(transfers, waits, step_times)]
    balance = memory_balance([r["peak_memory_bytes"] for r in rank_metrics], capacities)
    samples = math.fsum(r["samples"] for entry in ranks for r in entry["records"])
    return {
        "version": METRICS_VERSION,
        "world_size": world,
        "steps": steps,
        "step_time_s": step_times,
        "mean_step_time_s": total_time / len(steps),
        "samples_per_s": _ratio(samples, total_time),
        "heterogeneous_utilization": utilization,
        "communication_share": communication,
        "step_communication_share": step_shares,
        "transfer_share": math.fsum(r["transfer_share"] for r in rank_metrics) / world,
        "waiting_share": math.fsum(r["waiting_share"] for r in rank_metrics) / world,
        "memory_balance": balance,
        "health": {
            "utilization": health_status("utilization", utilization),
            "communication_share": health_status("communication_share", communication),
            "memory_balance": health_status("memory_balance", balance),
        },
        "ranks": rank_metrics,
        "plan": plan,
        "rebalance_events": [dict(event) for event in events],
        "speed_changes": speed_changes(steps, [entry["records"] for entry in ranks], emulation),
        "topology": topology,
    }
