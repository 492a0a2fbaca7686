# SPDX-License-Identifier: Apache-2.0
"""Compute-aware load balancing vs upstream's uniform split, on an emulated 2-rank cluster.

Workload: the project's small GPT (examples/tiny_gpt, bench size: seq 128, d 128, 4 layers),
forward+backward >= ~90% of a step. Rank 0 runs at full speed, rank 1 at 0.4 (a CPU-quota cgroup
where the machine allows it, else time dilation), one torch thread each.

For ZeRO 0-3, in one run, alternating: the uniform split (upstream's behaviour) and compute-aware
(5 profiling steps, then the measured plan). Each emulated device's solo throughput on the same
model and global batch gives the ideal: the sum of solo throughputs. Prints a table of samples/s,
speedup over uniform and fraction of ideal, and writes JSON.

    make perf                                    # all benchmarks
    python tests/perf/bench_load_balancing.py    # this one (from the repository root)
"""

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

SPEEDS = (1.0, 0.4)
GLOBAL_BATCH = 32
PROFILE_STEPS = 5
WARMUP_STEPS = 6  # covers the profiling steps of compute-aware
MEASURED_STEPS = 8
TARGETS = {0: 0.90, 1: 0.90, 2: 0.90, 3: 0.85}
RESULTS = REPO / "tests" / "perf" / "results" / "load_balancing.json"


def _train(rank, world_size, stage, strategy, speeds, global_batch):
    """One run; returns rank 0's samples/s over the measured steps and the plan in force."""
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch

    torch.set_num_threads(1)
    model = GPT(GPTConfig.bench(), seed=0)
    config = {
        "train_batch_size": global_batch,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": strategy, "profile_steps": PROFILE_STEPS,
                                 "emulation": {"speeds": list(speeds), "mode": "auto"}},
    }
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
    return {"samples_per_s": global_batch * MEASURED_STEPS / elapsed,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes), "emulation": runtime.emulation_mode}


def measure(stage, strategy, speeds=SPEEDS):
    return run_ranks(_train, world_size=len(speeds), timeout=900, args=(stage, strategy, speeds, GLOBAL_BATCH))[0]


def run(stages=(0, 1, 2, 3)):
    solo = [measure(0, "uniform", speeds=(speed, )) for speed in SPEEDS]
    ideal = sum(r["samples_per_s"] for r in solo)
    rows = []
    for stage in stages:
        uniform = measure(stage, "uniform")
        balanced = measure(stage, "compute_aware")
        rows.append({
            "zero_stage": stage, "uniform_samples_per_s": uniform["samples_per_s"],
            "compute_aware_samples_per_s": balanced["samples_per_s"], "compute_aware_plan": balanced["plan"],
            "speedup_over_uniform": balanced["samples_per_s"] / uniform["samples_per_s"],
            "uniform_fraction_of_ideal": uniform["samples_per_s"] / ideal,
            "fraction_of_ideal": balanced["samples_per_s"] / ideal, "target_fraction_of_ideal": TARGETS[stage],
            "meets_target": balanced["samples_per_s"] / ideal >= TARGETS[stage]
        })
    report = {
        "workload": "tiny GPT bench size (seq 128, d_model 128, 4 layers), fp32, 1 thread per rank",
        "speeds": list(SPEEDS), "global_batch": GLOBAL_BATCH, "measured_steps": MEASURED_STEPS,
        "emulation": solo[1]["emulation"], "solo_samples_per_s": [r["samples_per_s"] for r in solo],
        "ideal_samples_per_s": ideal, "stages": rows
    }
    print_table(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"JSON written to {RESULTS.relative_to(REPO)}")
    return report


def print_table(report):
    print(f"\nload balancing on an emulated cluster, speeds {report['speeds']} ({report['emulation']}), "
          f"global batch {report['global_batch']}")
    solo = report["solo_samples_per_s"]
    print(f"solo samples/s: {solo[0]:.2f} + {solo[1]:.2f} = ideal {report['ideal_samples_per_s']:.2f}")
    print(f"{'ZeRO':>4}  {'uniform/s':>9}  {'aware/s':>8}  {'plan':>9}  {'speedup':>7}  {'uniform/ideal':>13}  "
          f"{'aware/ideal':>11}  target")
    for row in report["stages"]:
        print(f"{row['zero_stage']:>4}  {row['uniform_samples_per_s']:>9.2f}  {row['compute_aware_samples_per_s']:>8.2f}  "
              f"{str(row['compute_aware_plan']):>9}  {row['speedup_over_uniform']:>6.2f}x  "
              f"{row['uniform_fraction_of_ideal']:>13.1%}  {row['fraction_of_ideal']:>11.1%}  "
              f"{row['target_fraction_of_ideal']:.0%} {'met' if row['meets_target'] else 'MISSED'}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    os.chdir(REPO)
    run(parser.parse_args().stages)
