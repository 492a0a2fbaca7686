# SPDX-License-Identifier: Apache-2.0
"""Compute-aware load balancing vs upstream's uniform split, on an emulated 2-rank cluster.

Workload: the project's small GPT (examples/tiny_gpt, bench size: seq 128, d 128, 4 layers),
forward+backward >= ~90% of a step. Rank 0 runs at full speed, rank 1 at 0.4 (``--speeds``),
one torch thread each.

For ZeRO 0-3, in one run: the uniform split (upstream's behaviour) and compute-aware (5
profiling steps, then the measured plan). Two yardsticks:

- ideal: each emulated device's solo throughput on the same model and global batch, summed. It
  charges nothing for communication, so a stage that communicates more (ZeRO-3) stays further
  from it whatever the balancing does.
- ceiling (``--ceiling``, on by default): the same stage on two full-speed ranks (no emulation),
  scaled by the speed sum, ``homogeneous * sum(speeds) / 2``: what the stage reaches if only the
  compute speed differed. ``fraction_of_ceiling = compute_aware / ceiling`` isolates what the
  heterogeneity itself costs, target 0.95 for every stage.

Emulation modes (``emulation/emulator.py``): ``auto`` (a CPU-quota cgroup where the machine allows it,
else time dilation) for every stage; ZeRO-3 is measured in both modes, because they differ
exactly where ZeRO-3 spends its time: the cgroup also throttles the slow rank's collective
processing (a CPU-bound interconnect), time dilation only its forward+backward (collectives and
the optimizer at full speed, closer to NCCL on a slower GPU). Solo throughputs are measured per
mode.

For ZeRO-3, a few further steps after the measured ones go through the heterogeneous profiler
(each rank's own compute, time inside collectives split into waiting and transfer) and a comm
clock listener that attributes the clock's time to the kind of collective that ran
(``breakdown`` in the JSON, per rank and per step). Per kind, as the profiler does for the total:
transfer = the least any rank spent in that kind in a step, waiting = a rank's excess over it.

``--zero3-settings upstream`` writes upstream's ZeRO-3 defaults into the config for the keys the
fork's heterogeneity-aware ZeRO-3 settings would choose (``zero3_settings.py``); a user-set value
wins, so this measures the fork without them (the "before").

``--repeats N`` runs every measurement N times: the table shows medians, and ``best/best`` is the
best compute-aware run over the best homogeneous one (other load on a shared machine only slows
a run, and slows the homogeneous run, which needs every core, more than the heterogeneous one);
the JSON keeps every run's throughput, plan and load average. Prints a table and writes JSON.

    make perf                                                    # all benchmarks
    python tests/perf/bench_load_balancing.py                    # this one (from the repository root)
    python tests/perf/bench_load_balancing.py --stages 3 --speeds 1.0 0.55 --repeats 2
    python tests/perf/bench_load_balancing.py --stages 2 --speeds 1.0 0.55 --sweep --no-ceiling

``--sweep`` (2 ranks) also measures the static splits [16, 16], [18, 14], ..., [30, 2] with the
manual strategy in the same window of steps as compute_aware (steps 7-14, the first 16 steps
holding profiling and that window): compute_aware over the best of them, target 0.95.
"""

import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

SPEEDS = (1.0, 0.4)
GLOBAL_BATCH = 32
PROFILE_STEPS = 5
WARMUP_STEPS = 6  # covers the profiling steps of compute-aware
MEASURED_STEPS = 8
BREAKDOWN_STEPS = 4  # after the measured ones, ZeRO-3 only: profiler + per-kind collective time
TARGETS = {0: 0.90, 1: 0.90, 2: 0.90, 3: 0.85}
CEILING_TARGET = 0.95
BEST_STATIC_TARGET = 0.95  # compute_aware over the best static split of the sweep (--sweep)
RESULTS = REPO / "tests" / "perf" / "results" / "load_balancing.json"


class CollectiveKinds:
    """Seconds inside collectives per kind of collective, from the fork's comm clock.

    A comm clock listener sees each collective before it runs; the clock's running total at that
    moment, minus its total at the previous collective, is the time of the collectives since, and
    is charged to the previous one's kind. Exact for blocking collectives; an asynchronous one's
    wait is charged to the kind issued last before it (ZeRO-3 waits for its parameter gathers right
    after issuing more of them, so mostly to the same kind)."""

    def __init__(self, clock):
        self._clock = clock
        self._kind = None
        self._mark = clock.seconds_in_collectives()
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    def __call__(self, func, args, kwargs):
        self._charge()
        self._kind = func.__name__
        self.calls[self._kind] += 1

    def _charge(self):
        now = self._clock.seconds_in_collectives()
        if self._kind is not None:
            self.seconds[self._kind] += now - self._mark
        self._mark = now

    def end_step(self):
        """This step's {kind: (calls, seconds)}; starts the next step's count."""
        self._charge()
        step = {kind: (self.calls[kind], self.seconds[kind]) for kind in self.calls}
        self._kind = None
        self.seconds, self.calls = defaultdict(float), defaultdict(int)
        return step


def _train(rank, world_size, stage, strategy, speeds, global_batch, mode, breakdown, zero3_settings, zero_extra=None,
           memory=None, manual=None):
    """One run; returns rank 0's samples/s over the measured steps, the plan in force and, with
    ``breakdown``, where each rank's time went in a few more steps."""
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch

    torch.set_num_threads(1)
    model = GPT(GPTConfig.bench(), seed=0)
    zero = {"stage": stage}
    if zero3_settings == "upstream" and stage == 3:
        from deepspeed.runtime.heterogeneous.memory.zero3_settings import UPSTREAM_DEFAULTS
        zero.update(UPSTREAM_DEFAULTS)
    zero.update(zero_extra or {})
    emulated = any(speed != 1.0 for speed in speeds)
    config = {
        "train_batch_size": global_batch,
        "steps_per_print": 10**6,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": strategy, "profile_steps": PROFILE_STEPS},
    }
    if manual is not None:  # a static split of the sweep
        config["heterogeneous_config"]["micro_batch_sizes"] = list(manual)
    if emulated:
        config["heterogeneous_config"]["emulation"] = {"speeds": list(speeds), "mode": mode}
    if memory is not None:
        config["heterogeneous_memory"] = memory
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=4096, seed=0)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset)
    batches = iter(loader)

    def step():
        inputs, targets = split_batch(next(batches))
        engine.backward(engine(inputs, targets))
        engine.step()

    for _ in range(WARMUP_STEPS):
        step()
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(MEASURED_STEPS):
        step()
    if world_size > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start
    runtime = engine._heterogeneous_runtime()
    result = {"samples_per_s": global_batch * MEASURED_STEPS / elapsed,
              "plan": list(engine.heterogeneous_plan.micro_batch_sizes),
              "emulation": runtime.emulation_mode if emulated else "none",
              "zero3_shares": getattr(engine.optimizer, "zero3_shares", None)}
    if breakdown:
        from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler
        profiler = HeterogeneousProfiler(engine)
        kinds = CollectiveKinds(comm_clock)
        profiler.start_heterogeneous_profile()
        comm_clock.set_listener(kinds)
        try:
            per_step = []
            for _ in range(BREAKDOWN_STEPS):
                step()
                per_step.append(kinds.end_step())
        finally:
            comm_clock.set_listener(None)
        profiler.stop_profile()
        result["kinds_per_step"] = per_step
        result["metrics"] = profiler.get_metrics() if rank == 0 else None
    return result


def measure(stage, strategy, speeds, mode="auto", breakdown=False, zero3_settings="fork", zero_extra=None, memory=None,
            manual=None):
    results = run_ranks(_train, world_size=len(speeds), timeout=900,
                        args=(stage, strategy, speeds, GLOBAL_BATCH, mode, breakdown, zero3_settings, zero_extra,
                              memory, manual))
    first = dict(results[0])
    # The emulation in force is the slowest rank's (a full-speed rank is not emulated).
    first["emulation"] = results[min(range(len(speeds)), key=lambda r: speeds[r])]["emulation"]
    if breakdown:
        first["breakdown"] = summarize_breakdown(first.pop("metrics"), [r["kinds_per_step"] for r in results])
        first.pop("kinds_per_step")
    return first


def summarize_breakdown(metrics, kinds_per_rank):
    """Per rank and optimizer step: own compute, optimizer, time inside collectives split into
    transfer and waiting (the profiler's definitions) and the same split per kind of collective.

    ``kinds_per_rank[r][s]``: rank r's {kind: (calls, seconds)} in step s."""
    steps = len(kinds_per_rank[0])
    all_kinds = sorted({kind for rank in kinds_per_rank for step in rank for kind in step})
    by_kind = {}  # kind -> (transfer per step summed, [waiting summed per rank], [seconds per rank], calls)
    for kind in all_kinds:
        transfer, waiting, seconds = 0.0, [0.0] * len(kinds_per_rank), [0.0] * len(kinds_per_rank)
        for s in range(steps):
            spent = [rank[s].get(kind, (0, 0.0))[1] for rank in kinds_per_rank]
            least = min(spent)
            transfer += least
            for r, value in enumerate(spent):
                waiting[r] += value - least
                seconds[r] += value
        calls = [sum(step.get(kind, (0, 0.0))[0] for step in rank) / steps for rank in kinds_per_rank]
        by_kind[kind] = (transfer, waiting, seconds, calls)
    ranks = []
    for r, entry in enumerate(metrics["ranks"]):
        timeline = entry["timeline"]
        wall = math.fsum(t["wall_s"] for t in timeline) / steps
        busy = math.fsum(t["busy_s"] for t in timeline) / steps
        waiting = math.fsum(t["waiting_s"] for t in timeline) / steps
        transfer = math.fsum(t["transfer_s"] for t in timeline) / steps
        ranks.append({
            "rank": r,
            "micro_batch_size": entry["micro_batch_sizes"],
            "wall_s": wall,
            "busy_s": busy,
            "forward_s": entry["forward_s_per_step"],
            "backward_s": entry["backward_s_per_step"],
            "optimizer_s": entry["optimizer_s_per_step"],
            "in_collectives_s": waiting + transfer,
            "transfer_s": transfer,
            "waiting_s": waiting,
            "other_s": wall - busy - waiting - transfer,
            "by_kind": {
                kind: {"calls": calls[r], "seconds": seconds[r] / steps, "transfer_s": transfer_k / steps,
                       "waiting_s": waiting_k[r] / steps}
                for kind, (transfer_k, waiting_k, seconds, calls) in by_kind.items()
            },
        })
    return {"steps": steps, "mean_step_time_s": metrics["mean_step_time_s"], "samples_per_s": metrics["samples_per_s"],
            "unit": "seconds per optimizer step", "ranks": ranks}


def _median_run(repeats, *args, **kwargs):
    """``repeats`` runs of ``measure``; the median throughput's run, with every run's throughput,
    plan and load average kept, and the best throughput (other load on a shared machine only ever
    slows a run down, so the best of a few runs is the least disturbed one)."""
    runs = []
    for _ in range(repeats):
        load = os.getloadavg()[0]
        runs.append({**measure(*args, **kwargs), "load_average": load})
    values = [r["samples_per_s"] for r in runs]
    chosen = dict(sorted(runs, key=lambda r: r["samples_per_s"])[(len(runs) - 1) // 2])
    chosen["samples_per_s"] = statistics.median(values)
    chosen["samples_per_s_best"] = max(values)
    chosen["runs"] = [{"samples_per_s": r["samples_per_s"], "plan": r["plan"], "load_average": r["load_average"]}
                      for r in runs]
    return chosen


def stage_modes(stage, modes):
    """The emulation modes a stage is measured in: ``modes`` when given, else auto, and ZeRO-3
    also under time dilation (see the module docstring)."""
    if modes:
        return list(modes)
    return ["auto", "dilation"] if stage == 3 else ["auto"]


def run(stages=(0, 1, 2, 3), speeds=SPEEDS, modes=None, ceiling=True, repeats=1, zero3_settings="fork",
        results=RESULTS, sweep=False):
    speeds = tuple(speeds)
    wanted = []
    for stage in stages:
        wanted += [m for m in stage_modes(stage, modes) if m not in wanted]
    solo, resolved, alone = {}, {}, {}
    for mode in wanted:
        runs = []
        for speed in speeds:
            key = (speed, mode if speed != 1.0 else "none")  # a full-speed rank is not emulated
            if key not in alone:
                alone[key] = _median_run(repeats, 0, "uniform", (speed, ), mode=mode)
            runs.append(alone[key])
        resolved[mode] = next((r["emulation"] for r in runs if r["emulation"] != "none"), "none")
        if resolved[mode] in {resolved[m] for m in solo}:
            continue  # 'auto' resolved to a mode measured already
        solo[mode] = runs
    rows = []
    for stage in stages:
        homogeneous = None
        if ceiling:
            homogeneous = _median_run(repeats, stage, "uniform", (1.0, ) * len(speeds), breakdown=stage == 3,
                                      zero3_settings=zero3_settings)
        for mode in stage_modes(stage, modes):
            source = next(m for m in solo if resolved[m] == resolved[mode])
            ideal = sum(r["samples_per_s"] for r in solo[source])
            if any(row["zero_stage"] == stage and row["emulation"] == resolved[mode] for row in rows):
                continue
            uniform = _median_run(repeats, stage, "uniform", speeds, mode=mode, zero3_settings=zero3_settings)
            balanced = _median_run(repeats, stage, "compute_aware", speeds, mode=mode, breakdown=stage == 3,
                                   zero3_settings=zero3_settings)
            row = {
                "zero_stage": stage, "emulation": balanced["emulation"], "ideal_samples_per_s": ideal,
                "solo_samples_per_s": [r["samples_per_s"] for r in solo[source]],
                "uniform_samples_per_s": uniform["samples_per_s"],
                "compute_aware_samples_per_s": balanced["samples_per_s"],
                "compute_aware_runs": balanced["runs"], "uniform_runs": uniform["runs"],
                "compute_aware_plan": balanced["plan"],
                "speedup_over_uniform": balanced["samples_per_s"] / uniform["samples_per_s"],
                "uniform_fraction_of_ideal": uniform["samples_per_s"] / ideal,
                "fraction_of_ideal": balanced["samples_per_s"] / ideal, "target_fraction_of_ideal": TARGETS[stage],
                "meets_target": balanced["samples_per_s"] / ideal >= TARGETS[stage]
            }
            if homogeneous is not None:
                ceiling_value = homogeneous["samples_per_s"] * sum(speeds) / len(speeds)
                row.update({
                    "homogeneous_samples_per_s": homogeneous["samples_per_s"],
                    "homogeneous_runs": homogeneous["runs"],
                    "ceiling_samples_per_s": ceiling_value,
                    "fraction_of_ceiling_best": balanced["samples_per_s_best"] / (
                        homogeneous["samples_per_s_best"] * sum(speeds) / len(speeds)),
                    "homogeneous_fraction_of_solo_sum": homogeneous["samples_per_s"] / (
                        len(speeds) * max(r["samples_per_s"] for r in solo[source])),
                    "fraction_of_ceiling": balanced["samples_per_s"] / ceiling_value,
                    "target_fraction_of_ceiling": CEILING_TARGET,
                    "meets_ceiling_target": balanced["samples_per_s"] / ceiling_value >= CEILING_TARGET,
                })
            if sweep and len(speeds) == 2:
                # Static splits around the speed ratio, each in the same window compute_aware is
                # measured in (steps 7-14: within the first 16, profiling included before them).
                row["sweep"] = []
                for extra in range(0, GLOBAL_BATCH // 2, 2):
                    split = [GLOBAL_BATCH // 2 + extra, GLOBAL_BATCH // 2 - extra]
                    static = _median_run(repeats, stage, "manual", speeds, mode=mode, zero3_settings=zero3_settings,
                                         manual=split)
                    row["sweep"].append({"plan": split, "samples_per_s": static["samples_per_s"]})
                best = max(row["sweep"], key=lambda entry: entry["samples_per_s"])
                row.update(best_static_plan=best["plan"], best_static_samples_per_s=best["samples_per_s"],
                           fraction_of_best_static=balanced["samples_per_s"] / best["samples_per_s"],
                           target_fraction_of_best_static=BEST_STATIC_TARGET)
            if "breakdown" in balanced:
                row["breakdown"] = {"compute_aware": balanced["breakdown"]}
                if homogeneous is not None and "breakdown" in homogeneous:
                    row["breakdown"]["homogeneous"] = homogeneous["breakdown"]
            rows.append(row)
    report = {
        "workload": "tiny GPT bench size (seq 128, d_model 128, 4 layers), fp32, 1 thread per rank",
        "speeds": list(speeds), "global_batch": GLOBAL_BATCH, "measured_steps": MEASURED_STEPS, "repeats": repeats,
        "zero3_settings": zero3_settings, "load_average": os.getloadavg(), "stages": rows
    }
    print_table(report)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=2))
    print(f"JSON written to {results}")
    return report


def print_table(report):
    print(f"\nload balancing on an emulated cluster, speeds {report['speeds']}, "
          f"global batch {report['global_batch']}, ZeRO-3 settings: {report['zero3_settings']}, "
          f"{report['repeats']} repeat(s), medians")
    print(f"{'ZeRO':>4}  {'emulation':>9}  {'ideal/s':>7}  {'uniform/s':>9}  {'aware/s':>8}  {'plan':>9}  "
          f"{'speedup':>7}  {'aware/ideal':>11}  target  {'homog/s':>7}  {'ceiling/s':>9}  {'aware/ceiling':>13}  "
          f"target  {'best/best':>9}")
    for row in report["stages"]:
        line = (f"{row['zero_stage']:>4}  {row['emulation']:>9}  {row['ideal_samples_per_s']:>7.2f}  "
                f"{row['uniform_samples_per_s']:>9.2f}  {row['compute_aware_samples_per_s']:>8.2f}  "
                f"{str(row['compute_aware_plan']):>9}  {row['speedup_over_uniform']:>6.2f}x  "
                f"{row['fraction_of_ideal']:>11.1%}  "
                f"{row['target_fraction_of_ideal']:.0%} {'met   ' if row['meets_target'] else 'MISSED'}")
        if "fraction_of_ceiling" in row:
            line += (f"  {row['homogeneous_samples_per_s']:>7.2f}  {row['ceiling_samples_per_s']:>9.2f}  "
                     f"{row['fraction_of_ceiling']:>13.1%}  {row['target_fraction_of_ceiling']:.0%} "
                     f"{'met   ' if row['meets_ceiling_target'] else 'MISSED'}  "
                     f"{row['fraction_of_ceiling_best']:>9.1%}")
        print(line)
    for row in report["stages"]:
        if "sweep" in row:
            splits = ", ".join(f"{entry['plan']} {entry['samples_per_s']:.1f}" for entry in row["sweep"])
            print(f"\nZeRO-{row['zero_stage']} ({row['emulation']}) static splits, samples/s: {splits}")
            print(f"  compute_aware {row['compute_aware_samples_per_s']:.1f} at {row['compute_aware_plan']} = "
                  f"{row['fraction_of_best_static']:.1%} of the best static split {row['best_static_plan']} "
                  f"(target {row['target_fraction_of_best_static']:.0%}: "
                  f"{'met' if row['fraction_of_best_static'] >= row['target_fraction_of_best_static'] else 'MISSED'})")
    for row in report["stages"]:
        for run_name, breakdown in row.get("breakdown", {}).items():
            emulation = row["emulation"] if run_name != "homogeneous" else "none"
            print(f"\nZeRO-{row['zero_stage']} {run_name} ({emulation}), "
                  f"seconds per step over {breakdown['steps']} steps, step {breakdown['mean_step_time_s']:.3f} s:")
            for rank in breakdown["ranks"]:
                kinds = ", ".join(f"{kind} {v['calls']:.0f}x {v['transfer_s'] * 1e3:.0f}+{v['waiting_s'] * 1e3:.0f}w ms"
                                  for kind, v in sorted(rank["by_kind"].items(), key=lambda kv: -kv[1]["seconds"]))
                print(f"  rank {rank['rank']} mbs {rank['micro_batch_size']}: wall {rank['wall_s']:.3f} = fwd "
                      f"{rank['forward_s']:.3f} + bwd {rank['backward_s']:.3f} + opt {rank['optimizer_s']:.3f} + "
                      f"transfer {rank['transfer_s']:.3f} + waiting {rank['waiting_s']:.3f} + other "
                      f"{rank['other_s']:.3f}")
                print(f"    by kind (transfer+waiting): {kinds}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--speeds", type=float, nargs="+", default=list(SPEEDS),
                        help=f"each rank's emulated speed (default {' '.join(map(str, SPEEDS))})")
    parser.add_argument("--modes", nargs="+", choices=["auto", "cgroup", "dilation"],
                        help="emulation modes for every stage (default: auto; ZeRO-3 auto and dilation)")
    parser.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                        help="measure each stage's homogeneous ceiling (default on)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement; medians (default 1)")
    parser.add_argument("--zero3-settings", choices=["fork", "upstream"], default="fork",
                        help="'upstream': upstream's ZeRO-3 defaults set in the config (the fork's choice bypassed)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON path")
    parser.add_argument("--sweep", action="store_true",
                        help="also measure static splits (manual) around the speed ratio, 2 ranks: the best static split")
    options = parser.parse_args()
    if any(not 0.0 < speed <= 1.0 for speed in options.speeds) or len(options.speeds) < 2:
        parser.error(f"--speeds: at least two values in (0, 1], got {options.speeds}")
    if options.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {options.repeats}")
    os.chdir(REPO)
    run(options.stages, options.speeds, options.modes, options.ceiling, options.repeats, options.zero3_settings,
        options.output.resolve(), options.sweep)
