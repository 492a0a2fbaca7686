# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler's output (docs/profiler.md): the printable report and the JSON
file, from the metrics ``heterogeneous_metrics.compute_metrics`` returns; the PNG timeline is
``heterogeneous_timeline.draw_timeline`` (it needs matplotlib), importable from here too.
"""

import json

from deepspeed.profiling.heterogeneous_timeline import describe_speed_change, draw_timeline

__all__ = ["draw_timeline", "format_metrics", "load_metrics", "write_metrics"]


def write_metrics(metrics, path):
    """Write ``metrics`` as JSON (per-step timeline included); ``load_metrics`` reads them back."""
    with open(path, "w") as handle:
        json.dump(metrics, handle, indent=1)
    return path


def load_metrics(path):
    """Metrics written by ``HeterogeneousProfiler.export_json``."""
    with open(path) as handle:
        return json.load(handle)


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
             f"{r.get('optimizer_s_per_step', 0):.3g} s",
             f"{_percent(r['compute_utilization'])} {r['health']['utilization']}",
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
    shares = metrics.get("step_communication_share")
    if shares:
        ordered = sorted(shares)
        lines.append(f"  communication share per step: min {_percent(ordered[0])}, median "
                     f"{_percent(ordered[len(ordered) // 2])}, max {_percent(ordered[-1])}, "
                     f"{sum(share >= 0.25 for share in shares)} of {len(shares)} step(s) at 25% or more")
    if metrics.get("topology"):
        lines.append(f"topology: {metrics['topology']['describe']}")
    if metrics.get("plan") is not None:
        from deepspeed.runtime.heterogeneous.planning.planner import Plan
        names = [r["device"] for r in metrics["ranks"]]
        lines += ["plan in force:", Plan.from_dict(metrics["plan"]).format_table(names)]
    events = metrics["rebalance_events"]
    lines.append("rebalance events:" + ("" if events else " none"))
    for event in events:
        lines.append(f"  step {event['step']}: micro-batches {list(event['old_sizes'])} -> "
                     f"{list(event['new_sizes'])}, predicted gain {_percent(event['predicted_gain'])}, "
                     f"observed {_percent(event.get('observed_gain'))}")
    changes = metrics.get("speed_changes") or []
    lines.append("speed changes:" + ("" if changes else " none"))
    lines += ["  " + describe_speed_change(change) for change in changes]
    return "\n".join(lines)
