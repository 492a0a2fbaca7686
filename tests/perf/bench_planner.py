# SPDX-License-Identifier: Apache-2.0
"""How long the planner takes for a large cluster: 4096 ranks of random time models (a fixed cost
up to 50 ms, 0.5-4 s per sample), half of them with a memory cap of 8-64 samples, a global batch of
4096 * 40 + 1234 samples, with and without per-rank gradient accumulation. Target (reported, not
asserted; the unit test checks the plan itself): under 1 s per plan. The median of 5 runs.

    python tests/perf/bench_planner.py          (from the repository root; about 10 s)

Writes tests/perf/results/planner.json.
"""

import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RANKS, REPEATS, TARGET_S = 4096, 5, 1.0
RESULTS = REPO / "tests" / "perf" / "results" / "planner.json"


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
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target_s": TARGET_S, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
