# SPDX-License-Identifier: Apache-2.0
"""Experiment outcomes, the choice of the best, the summary table and the lr advice (pure)."""

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

OK, OOM, FAILED, TIMEOUT, NO_METRICS, PREDICTED_OOM = ("ok", "out of memory", "failed", "timed out", "no metrics",
                                                       "predicted out of memory")
PROFILED = "profiling only"  # measured the ranks; not a candidate (heterogeneous_config is off)
PRUNED = "pruned by the plan"  # fast mode: a ZeRO stage predicted beyond autotuning.plan_pruning of the best
NOT_RUN = (PREDICTED_OOM, PRUNED)
"""Outcomes the tuner decided from predictions alone: no experiment ran."""

# Lines that mean the process ran out of memory. A run is never judged by the word "error"
# in its output (upstream marked any stderr line containing it as a failure); the exit status
# decides whether it failed, these patterns only say why.
_OOM_PATTERNS = re.compile(
    r"(OutOfMemoryError|CUDA out of memory|out of memory|EmulatedOutOfMemoryError|RankCannotFitError|"
    r"cannot allocate memory|std::bad_alloc|DefaultCPUAllocator: can't allocate memory|MemoryError)", re.IGNORECASE)
_SIGKILL = (-9, 137)


def lower_is_better(metric):
    return metric == "latency"


def metric_value(metrics, metric):
    """The metric from an experiment's metrics JSON ('flops' reads 'flops', then upstream's key)."""
    if metric == "flops":
        value = metrics.get("flops", metrics.get("FLOPS_per_gpu"))
    else:
        value = metrics.get(metric)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the metrics file has no finite '{metric}' value (keys: {sorted(metrics)})")
    return float(value)


def is_better(candidate, incumbent, metric):
    if incumbent is None:
        return True
    return candidate < incumbent if lower_is_better(metric) else candidate > incumbent


@dataclass
class Outcome:
    name: str
    stage: int
    status: str
    value: Optional[float] = None
    seconds: float = 0.0
    error: str = ""
    predicted: Optional[float] = None
    train_batch_size: Optional[int] = None
    micro_batch_sizes: Optional[List[int]] = None
    gas: Optional[int] = None
    metrics: Dict = field(default_factory=dict)
    folder: str = ""
    """The experiment's folder under exps_dir (logs, ds_config.json, metrics.json)."""
    pipeline_stages: Optional[int] = None
    """The pipeline degree (None: no pipeline tuned)."""
    partition: Optional[str] = None
    """heterogeneous_config.pipeline.partition (None: one stage, or no pipeline tuned)."""

    def to_dict(self):
        return asdict(self)


def select_best(outcomes, metric):
    """The successful outcome with the best metric (smallest latency, largest throughput/flops)."""
    best = None
    for outcome in outcomes:
        if outcome.status == OK and (best is None or is_better(outcome.value, best.value, metric)):
            best = outcome
    return best


def error_excerpt(stderr_text, stdout_text="", lines=12):
    """The real error: the last traceback (or the last lines) of the run's output."""
    text = stderr_text if stderr_text.strip() else stdout_text
    rows = [row for row in text.splitlines() if row.strip()]
    last = max((i for i, row in enumerate(rows) if row.startswith("Traceback")), default=None)
    if last is not None:
        block = rows[last:]
        return "\n".join(block[-lines:])
    return "\n".join(rows[-lines:])


def classify(returncode, stderr_text, stdout_text="", metrics_present=False, timed_out=False):
    """(status, message) of a finished experiment from its exit status and output."""
    if timed_out:
        return TIMEOUT, "killed after the experiment time-out (autotuning.experiment_timeout)"
    text = f"{stdout_text}\n{stderr_text}"
    if returncode == 0:
        if metrics_present:
            return OK, ""
        return NO_METRICS, ("the script exited 0 without writing metrics: it must pass its ds_config to "
                            "deepspeed.initialize (args with --deepspeed_config, or config=) and run at least "
                            "end_profile_step + 1 optimizer steps")
    if _OOM_PATTERNS.search(text) or (returncode in _SIGKILL and "Killed" in text):
        match = _OOM_PATTERNS.search(text)
        lines = [row for row in text.splitlines() if match and match.group(0) in row]
        return OOM, (lines[-1].strip() if lines else f"killed (exit {returncode}), likely by the OOM killer")
    return FAILED, error_excerpt(stderr_text, stdout_text) or f"exit status {returncode}"


def pipeline_label(degree, partition):
    """``pp2 balanced``, ``pp1`` (one stage: no cut)."""
    return f"pp{degree}" + (f" {partition}" if partition else "")


def format_summary(outcomes, metric, stages, pipeline_points=()):
    """The summary table: one row per ZeRO stage, one per (pipeline degree, partition) when the
    pipeline is tuned, and a global-best row."""
    header = ("tuning space", "experiments", f"best metric value ({metric})", "best experiment name")
    rows = []
    groups = [(f"z{stage}", lambda o, stage=stage: o.stage == stage) for stage in stages]
    groups += [(pipeline_label(d, p), lambda o, d=d, p=p: (o.pipeline_stages, o.partition) == (d, p))
               for d, p in pipeline_points]
    for label, member in groups:
        mine = [o for o in outcomes if member(o) and o.status not in NOT_RUN]
        best = select_best(mine, metric)
        rows.append((label, str(len(mine)), _fmt(best), best.name if best else "-"))
    ran = [o for o in outcomes if o.status not in NOT_RUN]
    best = select_best(ran, metric)
    rows.append(("global", str(len(ran)), _fmt(best), best.name if best else "-"))
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(4)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, _row(header, widths), line]
    out += [_row(r, widths) for r in rows]
    out.append(line)
    return "\n".join(out)


def _fmt(outcome):
    return "-" if outcome is None else f"{outcome.value:.4g}"


def _row(cells, widths):
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"


def lr_advice(config, new_batch, old_batch):
    """The square-root scaling advice when the tuned global batch differs from the user's."""
    if new_batch == old_batch:
        return None
    lr = ((config.get("optimizer") or {}).get("params") or {}).get("lr")
    if old_batch is None:
        return (f"The tuned global batch is {new_batch}; your config leaves it to the tuner. If your learning rate "
                f"was chosen for a global batch B_old, scale it: lr_new = lr_old * sqrt({new_batch} / B_old)"
                + (f" = {lr:g} * sqrt({new_batch} / B_old)" if isinstance(lr, (int, float)) else ""))
    text = (f"The tuned global batch ({new_batch}) differs from your train_batch_size ({old_batch}). Scale the "
            f"learning rate: lr_new = lr_old * sqrt(B_new / B_old)")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        new = lr * math.sqrt(new_batch / old_batch)
        text += f" = {lr:g} * sqrt({new_batch} / {old_batch}) = {new:.6g}"
    else:
        text += f" = lr_old * sqrt({new_batch} / {old_batch}) = lr_old * {math.sqrt(new_batch / old_batch):.4g}"
    return text
