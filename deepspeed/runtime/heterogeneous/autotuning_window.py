# SPDX-License-Identifier: Apache-2.0
"""Engine side of an autotuning experiment: measure, gather from every rank, write, exit.

The engine calls ``step_end`` after every step while ``autotuning.enabled`` (the
engine-autotuning-window patch); the tuner (``deepspeed/autotuning/heterogeneous``) only reads the
file written here, so the runtime imports nothing of the tool.

Upstream takes its metric from the timers of the last optimizer step (they are reset at every
step) on rank 0 only. Here every rank times a window of whole optimizer steps, wall clock from
one step's end to the next (the user's data loading included: it is part of what training
costs), with the accelerator synchronised at both ends. The window is the optimizer steps
``start_profile_step + 2 .. end_profile_step + 1`` (1-based): step ``start_profile_step + 1``
carries the FLOPS profiler's hooks on rank 0 and is left out. Rank 0 writes one JSON file::

    latency         mean seconds per optimizer step over the window (slowest rank)
    throughput      train_batch_size / latency (samples per second)
    flops           model FLOPs per second per rank (alias FLOPS_per_gpu, upstream's key)
    step_seconds    rank 0's seconds per window step
    ranks           per rank: micro-batch, gas, seconds per step, peak memory, capacity, device
    profile         with a heterogeneous compute_aware plan: the measured per-rank time and
                    activation models and seconds in collectives the tuner predicts candidates
                    with (costmodel.py)
"""

import json
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure.devices import cgroup_memory_limit, rank_memory_capacity


@dataclass
class AutotuningWindow:
    """The metric window's progress, kept on the engine's ``HeterogeneousState`` (which exists with
    the fork off too): the last optimizer step seen and the time at each step boundary in it."""

    last: Optional[int] = None
    marks: List[float] = field(default_factory=list)


def _window(engine):
    start = engine.autotuning_start_profile_step()
    end = engine.autotuning_end_profile_step()
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
        raise ValueError(f"autotuning.start_profile_step ({start!r}) and autotuning.end_profile_step ({end!r}) must be "
                         f"integers with 0 <= start_profile_step < end_profile_step: the metric is the mean over "
                         f"the optimizer steps between them")
    return start, end


def step_end(engine):
    """Called by the engine after every ``step()`` while autotuning is enabled."""
    home = engine._config.heterogeneous
    if home.autotuning_window is None:
        home.autotuning_window = AutotuningWindow()
    state = home.autotuning_window
    steps = engine.global_steps
    if steps == state.last:
        return  # not an accumulation boundary
    state.last = steps
    start, end = _window(engine)
    if start + 1 <= steps <= end + 1:
        get_accelerator().synchronize()
        if steps == start + 1:
            get_accelerator().reset_peak_memory_stats()
        state.marks.append(time.perf_counter())
    if steps == end + 1:
        _finish(engine, state.marks)


def _rank_profile(engine):
    runtime = engine._heterogeneous_runtime() if hasattr(engine, "_heterogeneous_runtime") else None
    if runtime is None or not runtime.decisions.history or not runtime.settings.strategy.adapts:
        return None
    from dataclasses import asdict
    from deepspeed.runtime.heterogeneous.memory.model_state import engine_model_state_inputs, fit_activation_model
    from deepspeed.runtime.heterogeneous.memory.meter import EMULATED
    from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec
    rank = runtime.rank
    measured = [(m, b) for step in runtime.decisions.history for m, _, b in step[rank]["samples"] if b is not None]
    activations = fit_activation_model(measured) if measured else None
    model = runtime.decisions.measured_time_models()[rank]
    from deepspeed.runtime.heterogeneous.planning.profiling import fit_steps
    steps = fit_steps(runtime.decisions.history)
    in_collectives = [step[rank].get("collective_s") for step in steps]
    return {
        "a": model.a,
        "b": model.b,
        "activation_base": activations.base if activations else 0.0,
        "activation_per_sample": activations.per_sample if activations else 0.0,
        **engine_model_state_inputs(engine),
        # What sizes DeepSpeed's buffers: the tuner's cost model predicts other stages' peaks from it.
        "allocations": asdict(ModelStateSpec.of_engine(engine, runtime.memory.meter.source == EMULATED).allocations),
        "capacity_bytes": None if runtime.capacities is None else runtime.capacities[rank],
        "utilization": runtime.state.settings.memory.hbm_utilization_threshold,
        "profile_gas": runtime.state.base_gas,
        # Seconds per step in collectives over the fitted profiling steps: what the tuner's cost model
        # turns into a bandwidth for the other stages' communication.
        "collective_seconds": None if None in in_collectives else sum(in_collectives) / len(in_collectives),
        "backend": _backend(),
    }


def _backend():
    """The process group's backend ("gloo", "nccl", ...): gloo runs a reduce-scatter as an all-reduce."""
    import torch.distributed
    try:
        return str(torch.distributed.get_backend())
    except (RuntimeError, ValueError):
        return None


def _device_name(engine, dp_rank):
    devices = engine.heterogeneous_devices
    if devices and dp_rank is not None and dp_rank < len(devices):
        return devices[dp_rank].name
    return get_accelerator().device_name()


def _finish(engine, marks):
    from deepspeed import comm as dist
    accelerator = get_accelerator()
    intervals = [later - earlier for earlier, later in zip(marks, marks[1:])]
    plan = engine.heterogeneous_plan
    rank = dist.get_rank()
    dp_rank = engine.heterogeneous_state.dp_rank if plan is not None else None
    mbs = plan.micro_batch_sizes[dp_rank] if plan is not None else engine.train_micro_batch_size_per_gpu()
    gas = plan.gradient_accumulation_steps[dp_rank] if plan is not None else engine.gradient_accumulation_steps()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")) or 1)
    try:
        device_bytes = accelerator.total_memory()
    except Exception:  # an accelerator without the query: no limit known
        device_bytes = None
    mine = {
        "rank": rank,
        "device": _device_name(engine, dp_rank),
        "micro_batch_size": int(mbs),
        "gradient_accumulation_steps": int(gas),
        "step_seconds": sum(intervals) / len(intervals),
        "peak_memory_bytes": int(accelerator.max_memory_allocated()),
        "memory_capacity_bytes": rank_memory_capacity(device_bytes, accelerator.device_name(), local,
                                                      cgroup_memory_limit()),
        "flops_per_micro_step": float(getattr(engine, "flops", 0) or 0) if rank == 0 else None,
        "profile": _rank_profile(engine),
    }
    from deepspeed.runtime.heterogeneous.cluster.agreement import Agreement
    agreement = Agreement(f"global rank {dist.get_rank()}")
    everyone = agreement.gather_to_rank0(mine, "the experiment's measurements")
    if rank == 0:
        latency = max(entry["step_seconds"] for entry in everyone)
        batch = engine.train_batch_size()
        # The FLOPS profiler counts rank 0's micro-step; FLOPs scale with samples, and ranks may
        # hold different micro-batches, so the step's total follows from rank 0's per sample.
        flops_per_sample = mine["flops_per_micro_step"] / max(1, mine["micro_batch_size"])
        flops = flops_per_sample * batch / latency / len(everyone)
        profiles = [entry.pop("profile") for entry in everyone]
        metrics = {
            "latency": latency,
            "throughput": batch / latency,
            "flops": flops,
            "FLOPS_per_gpu": flops,
            "train_batch_size": batch,
            "window_steps": len(intervals),
            "step_seconds": intervals,
            "ranks": everyone,
            "profile": None if any(p is None for p in profiles) else {
                "ranks": profiles,
                "devices": [entry["device"] for entry in everyone],
                "zero_stage": int(engine.zero_optimization_stage()),
                "plan": plan.to_dict() if plan is not None else None,
            },
        }
        path = engine.autotuning_metric_path()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(metrics, handle, indent=2)
        os.replace(tmp, path)  # the tuner never reads a half-written file
        print(f"Autotuning: wrote metrics of {len(intervals)} steps to {os.path.abspath(path)}", flush=True)
    agreement.barrier("rank 0 to write the experiment's metrics")
    # Not sys.exit: interpreter finalization can abort a gloo rank after the metrics were written.
    from deepspeed.runtime.heterogeneous.cli.process_exit import end_process
    end_process(0)
