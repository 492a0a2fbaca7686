# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 with memory-proportional shards against the fork's own equal shards, side by side.

Uneven shards must not cost speed. The workload of bench_load_balancing.py (the small GPT, global
batch 32, compute-aware split after 5 profiling steps) on two ranks at speeds [1.0, 0.55] by time
dilation, in ZeRO-3, run alternately:

- ``even``: ``heterogeneous_memory.zero_partitions: "even"`` (upstream's equal slices);
- ``shares``: the given shares (default: proportional to the speeds, [0.645, 0.355], what "auto"
  picks without a memory limit), so every gather pads rank 1's slice to rank 0's and rank 0 steps
  the larger part of the optimizer state.

Reported per arm: the median samples/s over ``--repeats`` runs, and the ratio shares / even
(goal: >= 0.95). Writes tests/perf/results/zero3_shards.json.

    python tests/perf/bench_zero3_shards.py [--repeats 3] [--speeds 1.0 0.55] [--shares 0.645 0.355]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "tests" / "perf")]

from bench_load_balancing import measure  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "zero3_shards.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speeds", type=float, nargs=2, default=[1.0, 0.55])
    parser.add_argument("--shares", type=float, nargs=2, default=None, help="default: proportional to the speeds")
    parser.add_argument("--mode", choices=["dilation", "cgroup", "auto"], default="dilation")
    args = parser.parse_args()
    shares = args.shares or [round(s / sum(args.speeds), 6) for s in args.speeds]
    shares[-1] = round(1.0 - sum(shares[:-1]), 6)
    arms = {"even": "even", "shares": shares}
    runs = {name: [] for name in arms}
    for repeat in range(args.repeats):
        for name, setting in arms.items():
            result = measure(3, "compute_aware", tuple(args.speeds), mode=args.mode,
                             memory={"zero_partitions": setting})
            result["load_average"] = os.getloadavg()[0]
            runs[name].append(result)
            print(f"run {repeat + 1}/{args.repeats} {name:6s}: {result['samples_per_s']:7.1f} samples/s, plan "
                  f"{result['plan']}, shares {result['zero3_shares']}, load {result['load_average']:.1f}", flush=True)
    medians = {name: statistics.median(r["samples_per_s"] for r in runs[name]) for name in arms}
    ratio = medians["shares"] / medians["even"]
    print(f"\nZeRO-3 at speeds {args.speeds} ({args.mode}): even {medians['even']:.1f} samples/s, shares {shares} "
          f"{medians['shares']:.1f} samples/s: {ratio:.3f}x (goal >= 0.95)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"speeds": args.speeds, "shares": shares, "mode": args.mode,
                                   "medians": medians, "ratio": ratio, "runs": runs,
                                   "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
