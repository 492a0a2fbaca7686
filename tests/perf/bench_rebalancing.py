# SPDX-License-Identifier: Apache-2.0
"""Dynamic rebalancing when a device slows down mid-run, and the cost of monitoring.

Workload: the project's small GPT (examples/tiny_gpt, bench size), 2 ranks, ZeRO-1, global batch
32, one torch thread per rank, compute_aware with 5 profiling steps. Both ranks start at full
speed; from step CHANGE_STEP rank 1 runs at 0.4 (a CPU-quota cgroup where the machine allows it,
else time dilation), like a device that throttles or gains a noisy neighbour.

In one run, side by side:

- static: the plan made after profiling stays (upstream's behaviour after start-up);
- dynamic: ``scheduler.dynamic_rebalancing`` with check_interval CHECK_INTERVAL, threshold 0.1.

Throughput is measured in three phases: before the change, right after it (the first check
interval), and after rebalancing (from two check intervals after the change on), each as a
fraction of that phase's ideal (the sum of each emulated device's solo throughput on the same
model and batch). Target: dynamic is back to >= 90% of the new ideal within two check intervals.

Monitoring overhead: the same model and run at a fixed even split, dynamic rebalancing's
monitoring on (whole-step timing, one device synchronisation per step, a check every
CHECK_INTERVAL steps) and off, alternating in blocks; the ratio of median step times (also the
profiler's per-micro-step recording, for comparison). Target: under 2%.

    python tests/perf/bench_rebalancing.py [--quick]      (from the repository root)
"""

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

GLOBAL_BATCH = 32
PROFILE_STEPS = 5
CHECK_INTERVAL = 5
CHANGE_STEP = 16
SLOW = 0.4
RESULTS = REPO / "tests" / "perf" / "results" / "rebalancing.json"


def _engine(stage, heterogeneous, seed=0):
    import torch
    import deepspeed
    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset

    torch.set_num_threads(1)
    model = GPT(GPTConfig.bench(), seed=seed)
    config = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, **heterogeneous}}
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=8192, seed=0)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset)
    return engine, iter(loader)


def _step(engine, batches):
    from examples.tiny_gpt import split_batch
    inputs, targets = split_batch(next(batches))
    engine.backward(engine(inputs, targets))
    engine.step()


def _timed_steps(engine, batches, count):
    """Wall seconds of each of ``count`` steps (ranks aligned before each)."""
    from deepspeed import comm as dist
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        _step(engine, batches)
        times.append(time.perf_counter() - start)
    return times


def _speed_change(rank, world_size, dynamic, steps):
    schedule = [{"step": CHANGE_STEP, "speeds": [1.0, SLOW]}]
    engine, batches = _engine(1, {
        "load_balancing_strategy": "compute_aware", "profile_steps": PROFILE_STEPS,
        "scheduler": {"dynamic_rebalancing": dynamic, "imbalance_threshold": 0.1, "check_interval": CHECK_INTERVAL},
        "emulation": {"speeds": [1.0, 1.0], "speed_schedule": schedule, "mode": "auto"}})
    times = _timed_steps(engine, batches, steps)
    runtime = engine._heterogeneous_runtime()
    return {"step_times": times, "emulation": runtime.emulation_mode,
            "events": [{"step": e.step, "old": list(e.old_sizes), "new": list(e.new_sizes),
                        "predicted_gain": e.predicted_gain, "observed_gain": e.observed_gain}
                       for e in runtime.decisions.events]}


def _solo(rank, world_size, speed, steps):
    heterogeneous = {"load_balancing_strategy": "uniform"}
    if speed < 1.0:
        heterogeneous["emulation"] = {"speeds": [speed], "mode": "auto"}
    engine, batches = _engine(1, heterogeneous)
    return _timed_steps(engine, batches, steps)


def _monitoring(rank, world_size, rounds, steps):
    """Alternate blocks of steps, same engine and split: dynamic rebalancing's monitoring off, on
    (whole-step timing, one device synchronisation per step, a check every CHECK_INTERVAL steps),
    and the profiler's per-micro-step recording on (what profiling steps cost)."""
    engine, batches = _engine(1, {
        "load_balancing_strategy": "compute_aware", "profile_steps": 0,
        # The threshold keeps the even split: only the cost of watching is measured.
        "scheduler": {"dynamic_rebalancing": True, "imbalance_threshold": 0.99, "check_interval": CHECK_INTERVAL}})
    runtime = engine._heterogeneous_runtime()
    _timed_steps(engine, batches, 3)  # warm-up
    off, dynamic, recording = [], [], []
    for _ in range(rounds):
        runtime.dynamic = False
        off += _timed_steps(engine, batches, steps)
        runtime.dynamic = True
        dynamic += _timed_steps(engine, batches, steps)
        runtime.dynamic = False
        runtime.start_recording()
        recording += _timed_steps(engine, batches, steps)
        runtime.stop_recording()
    return {"off": off, "dynamic": dynamic, "recording": recording}


def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _phase_rate(times, first, last):
    """Samples/s over steps first..last (1-based, inclusive), from the median step time."""
    return GLOBAL_BATCH / _median(times[first - 1:last])


def run(quick=False):
    steps = CHANGE_STEP + 4 * CHECK_INTERVAL + (0 if quick else 10)
    solo_steps = 4 if quick else 10
    fast = GLOBAL_BATCH / _median(run_ranks(_solo, world_size=1, timeout=900, args=(1.0, solo_steps))[0])
    slow = GLOBAL_BATCH / _median(run_ranks(_solo, world_size=1, timeout=900, args=(SLOW, solo_steps))[0])
    ideal_before, ideal_after = 2 * fast, fast + slow
    runs = {}
    for label, dynamic in (("static", False), ("dynamic", True)):
        fast_rank, slow_rank = run_ranks(_speed_change, world_size=2, timeout=1200, args=(dynamic, steps))
        runs[label] = {**fast_rank, "emulation": slow_rank["emulation"]}  # the rank that slows down
    # Phases: before (after profiling, before the change), right after (the first check interval
    # after the change), rebalanced (from two check intervals after the change to the end).
    phases = {"before": (PROFILE_STEPS + 2, CHANGE_STEP - 1),
              "right_after": (CHANGE_STEP, CHANGE_STEP + CHECK_INTERVAL - 1),
              "rebalanced": (CHANGE_STEP + 2 * CHECK_INTERVAL, steps)}
    ideals = {"before": ideal_before, "right_after": ideal_after, "rebalanced": ideal_after}
    table = {}
    for label, result in runs.items():
        table[label] = {phase: _phase_rate(result["step_times"], *span) / ideals[phase]
                        for phase, span in phases.items()}
    monitoring = run_ranks(_monitoring, world_size=2, timeout=900, args=(2 if quick else 4, 4 if quick else 8))[0]
    overhead = _median(monitoring["dynamic"]) / _median(monitoring["off"]) - 1.0
    recording_overhead = _median(monitoring["recording"]) / _median(monitoring["off"]) - 1.0
    report = {
        "workload": "tiny GPT bench size (seq 128, d_model 128, 4 layers), ZeRO-1, fp32, 1 thread per rank",
        "global_batch": GLOBAL_BATCH, "profile_steps": PROFILE_STEPS, "check_interval": CHECK_INTERVAL,
        "change": {"step": CHANGE_STEP, "rank": 1, "speed": SLOW}, "steps": steps,
        "emulation": runs["dynamic"]["emulation"], "solo_samples_per_s": {"1.0": fast, str(SLOW): slow},
        "ideal_samples_per_s": {"before": ideal_before, "after": ideal_after}, "phases": phases,
        "fraction_of_ideal": table, "events": runs["dynamic"]["events"],
        "monitoring_overhead": overhead, "recording_overhead": recording_overhead,
        "target_after_rebalancing": 0.90, "target_monitoring_overhead": 0.02,
        "meets_rebalancing_target": table["dynamic"]["rebalanced"] >= 0.90,
        "meets_monitoring_target": overhead < 0.02,
    }
    print_table(report)
    if not quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2))
        print(f"JSON written to {RESULTS.relative_to(REPO)}")
    return report


def print_table(report):
    change = report["change"]
    print(f"\ndynamic rebalancing: rank {change['rank']} 1.0 -> {change['speed']} at step {change['step']} "
          f"({report['emulation']}), check interval {report['check_interval']}, global batch {report['global_batch']}")
    ideal = report["ideal_samples_per_s"]
    print(f"ideal samples/s: {ideal['before']:.2f} before, {ideal['after']:.2f} after the change")
    print(f"{'plan':>8}  {'before':>7}  {'right after':>11}  {'rebalanced':>10}   (fraction of the phase's ideal)")
    for label, row in report["fraction_of_ideal"].items():
        print(f"{label:>8}  {row['before']:>7.1%}  {row['right_after']:>11.1%}  {row['rebalanced']:>10.1%}")
    for event in report["events"]:
        observed = "n/a" if event["observed_gain"] is None else f"{event['observed_gain']:.1%}"
        print(f"rebalance at step {event['step']}: {event['old']} -> {event['new']}, predicted gain "
              f"{event['predicted_gain']:.1%}, observed {observed}")
    print(f"target: dynamic >= 90% of the new ideal two check intervals after the change: "
          f"{report['fraction_of_ideal']['dynamic']['rebalanced']:.1%} "
          f"{'met' if report['meets_rebalancing_target'] else 'MISSED'}")
    print(f"per-micro-step recording (profiler, profiling steps) vs off: {report['recording_overhead']:+.2%}")
    print(f"monitoring overhead (dynamic rebalancing on vs off, same run and split): "
          f"{report['monitoring_overhead']:+.2%} "
          f"(target < 2%: {'met' if report['meets_monitoring_target'] else 'MISSED'})")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, no JSON (a smoke test)")
    os.chdir(REPO)
    run(parser.parse_args().quick)
