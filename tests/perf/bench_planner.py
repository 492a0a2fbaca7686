# SPDX-License-Identifier: Apache-2.0
"""How long planning takes for a large cluster, two ways:

- the planner alone (``plan_micro_batches``): 4096 ranks of random time models (a fixed cost up to
  50 ms, 0.5-4 s per sample), half of them with a memory cap of 8-64 samples, a global batch of
  4096 * 40 + 1234 samples, with and without per-rank gradient accumulation; the median of 5 runs;
- ``deepspeed plan``'s whole plan (``forecast.cluster_plan.plan_cluster``: upstream's even split and
  the fork's choice over ZeRO 0-3 and every micro-step count, the memory pool's placements, the
  largest model that fits) of a described cluster of 4 device kinds (H100, A100-80GB, A100-40GB,
  RTX-4090; hosts of 8, a quarter of the hosts each) and a 7B decoder given by numbers, 8 samples
  per rank, from 128 to 2048 ranks (1,024 ranks: 128 hosts); the median of 3 runs, with the time
  per rank to show that it grows linearly.

Target (reported, not asserted; the unit tests check the plans themselves): under 1 s per plan
for 4096 ranks of the planner and for 1,024 ranks of ``plan_cluster``.

    python tests/perf/bench_planner.py          (from the repository root; about 30 s)

Writes tests/perf/results/planner.json.
"""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RANKS, REPEATS, TARGET_S = 4096, 5, 1.0
CLUSTER_RANKS, CLUSTER_REPEATS, CLUSTER_TARGET_RANKS = (128, 256, 512, 1024, 2048), 3, 1024
RESULTS = REPO / "tests" / "perf" / "results" / "planner.json"
KINDS = (("H100", 2048, 7200), ("A100-80GB", 1024, 4800), ("A100-40GB", 1024, 4800), ("RTX-4090", 512, 128))
"""Kind, host memory (GB) and intra-host link (Gbit/s) of the described cluster's four quarters."""


def described_cluster(ranks):
    """``ranks`` ranks of 4 kinds on hosts of 8 (a quarter of the hosts each), 200 Gbit/s between
    hosts, a 7B decoder by numbers, 8 samples per rank, ZeRO stage "auto"."""
    from deepspeed.runtime.heterogeneous.forecast.cluster_file import parse_cluster
    hosts = ranks // 8 // len(KINDS)
    return parse_cluster({
        "name": f"{ranks} ranks of 4 kinds on {hosts * len(KINDS)} hosts",
        "hosts": [{"name": kind.lower(), "count": hosts, "devices": [{"kind": kind, "count": 8}],
                   "intra_host_link": {"gbit_per_s": link, "latency_us": 3}, "memory_gb": memory}
                  for kind, memory, link in KINDS],
        "inter_host_link": {"gbit_per_s": 200, "latency_us": 5},
        "model": {"parameters": 6.74e9, "layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096},
        "training": {"train_batch_size": 8 * ranks, "seq_len": 4096, "precision": "bf16", "zero_stage": "auto",
                     "activation_checkpointing": True}})


def cluster_rows():
    from deepspeed.runtime.heterogeneous.forecast.cluster_plan import plan_cluster
    rows = []
    for ranks in CLUSTER_RANKS:
        cluster = described_cluster(ranks)
        seconds, cpu = [], []
        for _ in range(CLUSTER_REPEATS):
            began, began_cpu = time.perf_counter(), time.process_time()
            plan = plan_cluster(cluster)
            seconds.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
        median = statistics.median(seconds)
        fork = plan["fork"]
        rows.append({"ranks": ranks, "hosts": plan["cluster"]["hosts"], "median_s": median, "runs_s": seconds,
                     "median_cpu_s": statistics.median(cpu), "load_average": os.getloadavg()[0],
                     "us_per_rank": median / ranks * 1e6, "fork_zero_stage": fork["zero_stage"],
                     "fork_gas": fork["gradient_accumulation_steps"], "speedup": plan["speedup"],
                     "offloading_ranks": sum(1 for r in fork["ranks"] if r["offload_fraction"] > 0),
                     "within_target": median < TARGET_S if ranks == CLUSTER_TARGET_RANKS else None})
        print(f"plan_cluster, {ranks} ranks on {plan['cluster']['hosts']} hosts: {median * 1000:.0f} ms per plan "
              f"({statistics.median(cpu) * 1000:.0f} ms of CPU; {median / ranks * 1e6:.0f} us per rank; median of "
              f"{CLUSTER_REPEATS}; load {os.getloadavg()[0]:.1f}; fork: ZeRO-{fork['zero_stage']}, "
              f"gas {fork['gradient_accumulation_steps']}, {plan['speedup']:.2f}x upstream)"
              + (f"; {'met' if median < TARGET_S else 'NOT met'} the {TARGET_S:g} s target"
                 if ranks == CLUSTER_TARGET_RANKS else ""), flush=True)
    return rows


def main():
    from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
    rng = random.Random(7)
    models = [TimeModel(rng.uniform(0, 0.05), rng.uniform(0.5, 4.0)) for _ in range(RANKS)]
    caps = [rng.choice([None, rng.randint(8, 64)]) for _ in models]
    batch = RANKS * 40 + 1234
    rows = []
    for per_rank_gas in (False, True):
        seconds = []
        for _ in range(REPEATS):
            began = time.perf_counter()
            plan = plan_micro_batches(models, batch, max_micro_batch=caps, allow_per_rank_gas=per_rank_gas)
            seconds.append(time.perf_counter() - began)
        assert sum(plan.samples_per_rank) == batch
        median = statistics.median(seconds)
        rows.append({"ranks": RANKS, "per_rank_gas": per_rank_gas, "median_s": median, "runs_s": seconds,
                     "fraction_of_budget": median / TARGET_S, "within_target": median < TARGET_S})
        print(f"{RANKS} ranks, per-rank gas {'on' if per_rank_gas else 'off'}: {median * 1000:.0f} ms per plan, "
              f"{median / TARGET_S:.1%} of the {TARGET_S:g} s budget (median of {REPEATS}; "
              f"{'met' if median < TARGET_S else 'NOT met'})")
    clusters = cluster_rows()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target_s": TARGET_S, "load_average": os.getloadavg(), "rows": rows,
                                   "cluster_rows": clusters}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
