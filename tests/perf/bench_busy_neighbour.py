# SPDX-License-Identifier: Apache-2.0
"""A busy neighbour beside the fast rank: is the plan the fork settles on ever slower than uniform?

The setting of tests/unit/heterogeneous/test_busy_neighbour.py (each rank pinned to a core, two
spinning processes on rank 0's, rank 1 emulated at 0.5 by a CPU quota set by hand, so the rank
emulated as the fast one is the slower). In one group, under the same neighbours, uniform [8, 8]
and compute_aware; the step time of each is the median of the last 8 steps (at the plan that
stays). Target (reported, not asserted): compute_aware within the timing noise of a loaded 2-core
machine, 35%, of uniform's step time. [1, 127] once ran several times uniform's step time, and
[3, 13], which the switch check used to keep here, +16% to +42%.

    python tests/perf/bench_busy_neighbour.py [--repeats N]     (root, about 1 min per repeat)

Writes tests/perf/results/busy_neighbour.json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "tests" / "unit" / "heterogeneous")]

from harness import run_subcases  # noqa: E402
from test_busy_neighbour import LAST, _run  # noqa: E402

TOLERANCE = 0.35
RESULTS = REPO / "tests" / "perf" / "results" / "busy_neighbour.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for repeat in range(args.repeats):
        (uniform, _), (fork, _) = run_subcases(_run, [dict(strategy="uniform"), dict(strategy="compute_aware")],
                                               world_size=2, timeout=900)
        uniform_s = statistics.median(uniform["walls"][-LAST:])
        fork_s = statistics.median(fork["walls"][-LAST:])
        ratio = fork_s / uniform_s
        rows.append({"repeat": repeat, "uniform_s": uniform_s, "compute_aware_s": fork_s, "ratio": ratio,
                     "final_plan": fork["plans"][-1], "within": ratio <= 1 + TOLERANCE})
        print(f"repeat {repeat}: uniform {uniform_s * 1000:.1f} ms, compute_aware {fork_s * 1000:.1f} ms per step at "
              f"{fork['plans'][-1]}: {ratio:.2f}x uniform's step time", flush=True)
    within = sum(row["within"] for row in rows)
    print(f"compute_aware within {TOLERANCE:.0%} of uniform's step time in {within} of {len(rows)} runs (target: all)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"tolerance": TOLERANCE, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
