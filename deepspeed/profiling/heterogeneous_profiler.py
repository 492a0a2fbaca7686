# SPDX-License-Identifier: Apache-2.0
"""Where each data-parallel rank's step time goes on a heterogeneous cluster (docs/profiler.md).

    profiler = HeterogeneousProfiler(engine)    # or the module deepspeed.initialize wrapped
    profiler.start_heterogeneous_profile()      # every rank, at the same step
    ...train...
    profiler.stop_profile()                     # every rank, at the same step (a collective)
    profiler.print_heterogeneous_metrics()      # rank 0 prints; every rank can query
    profiler.save()                             # rank 0: hetero_profile/profile.json, timeline.png

While profiling, the engine's heterogeneous runtime records, per rank and optimizer step ``s``,
the rank's own compute (forward + backward) and optimizer seconds with time inside collectives
excluded, the wall seconds it spent inside collectives (waiting for peers included), its wall
step time, its samples and the largest bytes one micro-step saved for backward.
``stop_profile`` gathers every rank's records, so every rank computes the same metrics.
Start between optimizer steps: the first profiled step is timed from the call to
``start_heterogeneous_profile`` on.

The metrics and their definitions are in ``heterogeneous_metrics.py``: pure functions over plain
records (``compute_metrics`` and its helpers). The report and the JSON file are in
``heterogeneous_report.py``, the PNG timeline in ``heterogeneous_timeline.py``. Only
``HeterogeneousProfiler.stop_profile`` talks to other ranks. The metrics also carry the plan in
force when profiling stopped, the rebalance events of the profiled steps and the ranks' speed
changes (measured, and asked by an emulation's ``speed_schedule``). ``save()`` writes the JSON and
the timeline into a folder. The timeline needs matplotlib (``pip install matplotlib``), imported
only there; the rest does not. Every name listed in ``__all__`` stays importable from this module.
"""

import os

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.profiling.heterogeneous_metrics import (HEALTH_TARGETS, compute_metrics, health_status, memory_balance,
                                                       merge_replicas, split_collective_time)
from deepspeed.profiling.heterogeneous_metrics import METRICS_VERSION  # noqa: F401 (once defined here)
from deepspeed.profiling.heterogeneous_report import draw_timeline, format_metrics, load_metrics, write_metrics

# Where ``save()`` writes unless told: a folder of its own, which .gitignore names.
DEFAULT_OUTPUT_DIRECTORY = "hetero_profile"

__all__ = [
    "DEFAULT_OUTPUT_DIRECTORY", "HEALTH_TARGETS", "HeterogeneousProfiler", "compute_metrics", "draw_timeline",
    "format_metrics", "health_status", "load_metrics", "memory_balance", "merge_replicas", "split_collective_time"
]


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


def _topology_dict(topology):
    """The hosts and measured links for the metrics (None on one host or without a topology)."""
    if topology is None or topology.num_hosts == 1:
        return None
    return {**topology.to_dict(), "describe": topology.describe()}


def _emulation_dict(emulation, world_size):
    """The emulated speeds per data-parallel rank for the metrics' speed changes; None without
    them or where the lists are per process (a pipeline's), not per data-parallel rank."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule):
        return None
    schedule = [{"step": change.step, "speeds": list(change.speeds)} for change in emulation.speed_schedule or []]
    speeds = list(emulation.speeds) if emulation.speeds else None
    if any(len(entry) != world_size for entry in [speeds or [None] * world_size] + [c["speeds"] for c in schedule]):
        return None
    return {"speeds": speeds, "speed_schedule": schedule}


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
                "events": [_event_dict(e) for e in runtime.decisions.events
                           if self.start_step < e.step <= runtime.steps]}
        try:
            gathered = runtime.agreement.gather_from_every_rank(mine, "the other ranks' profiler records")
        except Exception as exc:
            raise RuntimeError(f"HeterogeneousProfiler.stop_profile(): every rank must call stop_profile() at the "
                               f"same step: {exc}") from exc
        self._snapshot = {
            "ranks": merge_replicas(gathered, runtime.plan.world_size),
            "capacities": runtime.capacities,
            "plan": runtime.plan.to_dict(),
            "device_names": self.engine.heterogeneous_state.device_names,
            "events": gathered[0]["events"],
            "topology": _topology_dict(self.engine.heterogeneous_state.topology),
            "emulation": _emulation_dict(runtime.settings.emulation, runtime.plan.world_size),
        }
        self._metrics = None

    def _peak_bytes(self, records):
        if self._measures_device_memory:
            return int(get_accelerator().max_memory_allocated())
        activations = [r["activation_bytes"] for r in records if r["activation_bytes"] is not None]
        return int(self.runtime.memory.model_state_bytes() + (max(activations) if activations else 0))

    def get_metrics(self):
        """The metrics of the last profile as a dict (see ``heterogeneous_metrics`` for the definitions)."""
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
        return write_metrics(self.get_metrics(), path)

    def save_timeline(self, path):
        """Write the timeline PNG to ``path`` (needs matplotlib; see ``draw_timeline``)."""
        return draw_timeline(self.get_metrics(), path)

    def save(self, directory=DEFAULT_OUTPUT_DIRECTORY):
        """Write ``profile.json`` and ``timeline.png`` into ``directory`` (created; default
        ``hetero_profile`` under the working directory) on global rank 0; every rank gets the paths
        back, ``{"json": ..., "timeline": ...}``. Without matplotlib the timeline is skipped with a
        line that says how to install it, and its path is None."""
        paths = {"json": os.path.join(directory, "profile.json"), "timeline": os.path.join(directory, "timeline.png")}
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            self.export_json(paths["json"])
        try:
            import matplotlib  # noqa: F401 (only whether it is there: the drawing imports what it uses)
        except ImportError:
            if dist.get_rank() == 0:
                print(f"HeterogeneousProfiler.save(): no {paths['timeline']}: the timeline needs matplotlib "
                      f"(pip install matplotlib)", flush=True)
            return {**paths, "timeline": None}
        if dist.get_rank() == 0:
            self.save_timeline(paths["timeline"])
        return paths
