# SPDX-License-Identifier: Apache-2.0
"""Where each data-parallel rank's step time goes on a heterogeneous cluster (docs/architecture.md §4.7).

    profiler = HeterogeneousProfiler(engine)    # or the module deepspeed.initialize wrapped
    profiler.start_heterogeneous_profile()      # every rank, at the same step
    ...train...
    profiler.stop_profile()                     # every rank, at the same step (a collective)
    profiler.print_heterogeneous_metrics()      # rank 0 prints; every rank can query

While profiling, the engine's heterogeneous runtime records, per rank and optimizer step ``s``,
the rank's own compute (forward + backward) and optimizer seconds with time inside collectives
excluded, the wall seconds it spent inside collectives (waiting for peers included), its wall
step time, its samples and the largest bytes one micro-step saved for backward.
``stop_profile`` gathers every rank's records, so every rank computes the same metrics.
Start between optimizer steps: the first profiled step is timed from the call to
``start_heterogeneous_profile`` on.

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
- Health targets from the seed: utilisation > 75% (else LOW), communication share < 25% (else
  HIGH), memory balance > 0.8 (else LOW); ``n/a`` when a value is unknown.

The metrics also carry the plan in force when profiling stopped and the rebalance events of the
profiled steps. The math is in pure functions over plain records (``compute_metrics`` and its
helpers); only ``HeterogeneousProfiler.stop_profile`` talks to other ranks. ``save_timeline``
needs matplotlib (``pip install matplotlib``), imported only there; the rest does not.
"""

import json
import math

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.agreement import merge_replicas as merge_model_parallel_peers

__all__ = [
    "HEALTH_TARGETS", "HeterogeneousProfiler", "compute_metrics", "draw_timeline", "format_metrics", "health_status",
    "load_metrics", "memory_balance", "merge_replicas", "split_collective_time"
]

METRICS_VERSION = 1

HEALTH_TARGETS = {
    # name: (target, True when the value must be above it)
    "utilization": (0.75, True),
    "communication_share": (0.25, False),
    "memory_balance": (0.8, True),
}

_RECORD_FIELDS = ("compute_s", "forward_s", "backward_s", "optimizer_s", "collective_s", "wall_s", "activation_bytes")

# -- pure metrics -----------------------------------------------------------------------------


def health_status(name, value):
    """'ok', 'LOW' or 'HIGH' for ``value`` against the seed's target ``name``; 'n/a' for None."""
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


def compute_metrics(ranks, capacities=None, plan=None, device_names=None, events=()):
    """The profile's metrics (a JSON-ready dict) from per-rank records (see the module docstring).

    Args:
        ranks: one ``{"records": [...], "peak_bytes": int or None}`` per data-parallel rank, in rank
            order; records as the runtime writes them, the same steps on every rank.
        capacities: per-rank memory capacity in bytes (entries may be None), or None.
        plan: the plan in force as ``Plan.to_dict()``, or None.
        device_names: per-rank device names, or None.
        events: rebalance events as dicts (``step``, ``old_sizes``, ``new_sizes``, ...).
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
    }


def load_metrics(path):
    """Metrics written by ``HeterogeneousProfiler.export_json``."""
    with open(path) as handle:
        return json.load(handle)


# -- presentation -----------------------------------------------------------------------------


def _percent(value):
    return "-" if value is None else f"{100 * value:.1f}%"


def _bytes(value):
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value} B"


def _table(header, rows):
    widths = [max(len(row[column]) for row in [header] + rows) for column in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header] + rows]


def format_metrics(metrics):
    """The printable report: per-rank table, health targets, plan in force, rebalance events."""
    steps = metrics["steps"]
    lines = [f"deepspeed-hetero profile: steps {steps[0]}-{steps[-1]} ({len(steps)}), {metrics['world_size']} "
             f"data-parallel ranks, mean step time {metrics['mean_step_time_s']:.4g} s, "
             f"{metrics['samples_per_s']:.4g} samples/s"]
    header = ("rank", "device", "mbs", "samples/step", "fwd/bwd/opt per step", "utilisation", "comm", "transfer",
              "waiting", "peak mem", "mem util")
    rows = [(str(r["rank"]), r["device"], ",".join(map(str, r["micro_batch_sizes"])), f"{r['samples_per_step']:.4g}",
             f"{r.get('forward_s_per_step', 0):.3g}/{r.get('backward_s_per_step', 0):.3g}/"
             f"{r.get('optimizer_s_per_step', 0):.3g} s", f"{_percent(r['compute_utilization'])} {r['health']['utilization']}",
             f"{_percent(r['communication_share'])} {r['health']['communication_share']}",
             _percent(r["transfer_share"]), _percent(r["waiting_share"]), _bytes(r["peak_memory_bytes"]),
             _percent(r["memory_utilization"])) for r in metrics["ranks"]]
    lines += _table(header, rows)
    balance = metrics["memory_balance"]
    targets = [("heterogeneous utilisation", _percent(metrics["heterogeneous_utilization"]), "> 75%", "utilization"),
               ("communication share", _percent(metrics["communication_share"]), "< 25%", "communication_share"),
               ("memory balance", "-" if balance is None else f"{balance:.3g}", "> 0.8", "memory_balance")]
    lines.append("health targets:")
    lines += ["  " + line for line in _table(("metric", "value", "target", "status"),
                                             [(name, value, target, metrics["health"][key])
                                              for name, value, target, key in targets])]
    lines.append(f"  (communication: transfer {_percent(metrics['transfer_share'])}, waiting for slower ranks "
                 f"{_percent(metrics['waiting_share'])})")
    if metrics.get("plan") is not None:
        from deepspeed.runtime.heterogeneous.planner import Plan
        names = [r["device"] for r in metrics["ranks"]]
        lines += ["plan in force:", Plan.from_dict(metrics["plan"]).format_table(names)]
    events = metrics["rebalance_events"]
    lines.append("rebalance events:" + ("" if events else " none"))
    for event in events:
        lines.append(f"  step {event['step']}: micro-batches {list(event['old_sizes'])} -> "
                     f"{list(event['new_sizes'])}, predicted gain {_percent(event['predicted_gain'])}, "
                     f"observed {_percent(event.get('observed_gain'))}")
    return "\n".join(lines)


def _step_end_times(metrics):
    ends, now = [], 0.0
    for seconds in metrics["step_time_s"]:
        now += seconds
        ends.append(now)
    return ends


def draw_timeline(metrics, path):
    """Write a PNG timeline of ``metrics`` (as ``get_metrics()`` or ``load_metrics()`` gives them).

    One row per rank; each step occupies its step time ``T_s`` on the time axis and holds the
    rank's busy, waiting and transfer seconds side by side (totals of the step, not the order in
    which they happened); the rest of the step is other work (data loading, the user's loop).
    Rebalance events are vertical lines at the end of their step. Needs matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("HeterogeneousProfiler.save_timeline() draws with matplotlib, which is not installed: "
                          "pip install matplotlib") from exc
    ranks = metrics["ranks"]
    # The object API with the Agg canvas leaves pyplot's global backend to the user.
    figure = Figure(figsize=(10, 1.6 + 0.7 * len(ranks)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    ends = _step_end_times(metrics)
    starts = [0.0] + ends[:-1]
    colours = {"busy": "tab:green", "waiting": "tab:orange", "transfer": "tab:blue"}
    for row, rank in enumerate(ranks):
        spans = {kind: [] for kind in colours}
        for start, entry in zip(starts, rank["timeline"]):
            at = start
            for kind in colours:
                seconds = max(entry[f"{kind}_s"], 0.0)
                spans[kind].append((at, seconds))
                at += seconds
        for kind, colour in colours.items():
            axes.broken_barh(spans[kind], (row - 0.35, 0.7), facecolors=colour, label=kind if row == 0 else None)
    for end in ends:
        axes.axvline(end, color="0.85", linewidth=0.5, zorder=0)
    for event in metrics["rebalance_events"]:
        if event["step"] in metrics["steps"]:
            at = ends[metrics["steps"].index(event["step"])]
            axes.axvline(at, color="tab:red", linestyle="--")
            axes.text(at, len(ranks) - 0.4, f" rebalance {list(event['old_sizes'])} -> {list(event['new_sizes'])}",
                      color="tab:red", fontsize=8, va="bottom")
    axes.set_yticks(range(len(ranks)), [f"rank {r['rank']} ({r['device']})" for r in ranks])
    axes.set_ylim(len(ranks) - 0.3, -0.7)
    axes.set_xlim(0, ends[-1] if ends else 1)
    axes.set_xlabel("seconds since the first profiled step")
    axes.set_title(f"steps {metrics['steps'][0]}-{metrics['steps'][-1]}: heterogeneous utilisation "
                   f"{_percent(metrics['heterogeneous_utilization'])}, communication "
                   f"{_percent(metrics['communication_share'])}")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


# -- the profiler (the collective lives here) ---------------------------------------------------


def _find_engine(model):
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.heterogeneous.engine import engine_of

    if isinstance(model, DeepSpeedEngine):
        return model
    # A module does not know its engine; every engine registers itself when it is built.
    engines = engine_of(model)
    if len(engines) != 1:
        found = "no DeepSpeed engine wraps" if not engines else f"{len(engines)} DeepSpeed engines wrap"
        raise ValueError(f"HeterogeneousProfiler: {found} this {type(model).__name__}; pass the engine that "
                         f"deepspeed.initialize() returned: engine, *_ = deepspeed.initialize(...); "
                         f"HeterogeneousProfiler(engine)")
    return engines[0]


def _event_dict(event):
    return {"step": event.step, "old_sizes": list(event.old_sizes), "new_sizes": list(event.new_sizes),
            "predicted_gain": event.predicted_gain, "step_time_before": event.step_time_before,
            "step_time_after": event.step_time_after, "observed_gain": event.observed_gain}


class HeterogeneousProfiler:
    """Per-rank utilisation, communication and memory of a heterogeneous engine over some steps.

    Args:
        model: the engine ``deepspeed.initialize`` returned, or the module it wraps. The engine's
            config must enable ``heterogeneous_config``.
    """

    def __init__(self, model):
        self.engine = _find_engine(model)
        self.runtime = self.engine._heterogeneous_runtime()
        if self.runtime is None:
            raise ValueError("HeterogeneousProfiler needs heterogeneous_config.enabled = true in the DeepSpeed "
                             "config: the per-rank measurements come from the heterogeneous runtime")
        self.start_step = None
        self._snapshot = None
        self._metrics = None

    @property
    def _measures_device_memory(self):
        # The CPU accelerator's max_memory_allocated is the host process's RSS, not what training holds.
        return get_accelerator().current_device_name() != "cpu"

    def start_heterogeneous_profile(self):
        """Record from the next optimizer step on (call on every rank at the same step, between
        steps). Clears the records of an earlier profile; on a non-CPU accelerator it also resets
        the device's peak-memory statistics, which the profile's peak memory is read from."""
        self.runtime.start_recording()
        self.start_step = self.runtime.steps
        self._snapshot = self._metrics = None
        if self._measures_device_memory:
            get_accelerator().reset_peak_memory_stats()

    def stop_profile(self):
        """Stop recording and gather every rank's records; a collective: every rank calls it at the
        same step. Afterwards every rank can query the metrics."""
        if self.start_step is None:
            raise RuntimeError("HeterogeneousProfiler.stop_profile(): call start_heterogeneous_profile() first")
        runtime = self.runtime
        records = runtime.stop_recording()
        mine = {"dp_rank": runtime.rank, "records": records, "peak_bytes": self._peak_bytes(records),
                # Only rank 0 fills in the observed gain of an event: every rank takes rank 0's.
                "events": [_event_dict(e) for e in runtime.events if self.start_step < e.step <= runtime.steps]}
        gathered = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, mine)
        except Exception as exc:
            raise RuntimeError(f"HeterogeneousProfiler.stop_profile(): data-parallel rank {runtime.rank} could not "
                               f"gather the other ranks' records; every rank must call stop_profile() at the same "
                               f"step, and a peer failed or timed out ({exc})") from exc
        devices = self.engine.heterogeneous_devices
        self._snapshot = {
            "ranks": merge_replicas(gathered, runtime.plan.world_size),
            "capacities": runtime.capacities,
            "plan": runtime.plan.to_dict(),
            "device_names": [d.name for d in devices] if devices else None,
            "events": gathered[0]["events"],
        }
        self._metrics = None

    def _peak_bytes(self, records):
        if self._measures_device_memory:
            return int(get_accelerator().max_memory_allocated())
        activations = [r["activation_bytes"] for r in records if r["activation_bytes"] is not None]
        return int(self.runtime.model_state_bytes() + (max(activations) if activations else 0))

    def get_metrics(self):
        """The metrics of the last profile as a dict (see the module docstring for the definitions)."""
        if self._snapshot is None:
            raise RuntimeError("HeterogeneousProfiler: no finished profile; call start_heterogeneous_profile(), "
                               "train, then stop_profile() on every rank")
        if self._metrics is None:
            self._metrics = compute_metrics(**self._snapshot)
        return self._metrics

    def get_device_utilization(self):
        """Compute utilisation (busy / step time) of every data-parallel rank, in rank order."""
        return [rank["compute_utilization"] for rank in self.get_metrics()["ranks"]]

    def print_heterogeneous_metrics(self):
        """Print the report on rank 0; every rank gets its text back."""
        text = format_metrics(self.get_metrics())
        if dist.get_rank() == 0:
            print(text, flush=True)
        return text

    def export_json(self, path):
        """Write the metrics (per-step timeline included) as JSON; ``load_metrics`` reads them back."""
        with open(path, "w") as handle:
            json.dump(self.get_metrics(), handle, indent=1)
        return path

    def save_timeline(self, path):
        """Write the timeline PNG to ``path`` (needs matplotlib; see ``draw_timeline``)."""
        return draw_timeline(self.get_metrics(), path)
