# SPDX-License-Identifier: Apache-2.0
"""Fused gradient unscale (``native.unscale_maxabs_``) vs torch's unfused sequence and a copy.

Workload: ``--elements`` in all (default 100M), split over ``--tensors`` gradients (default 64),
for float32, bfloat16 and float16, on the current accelerator. In one run, round-robin over
``--repeats`` rounds, each of:

- fused: one native pass that unscales in place, takes the finite max |x| and detects inf/nan;
- unfused: ``native.unscale_maxabs_reference_``, torch's sequence (mul_, abs, isfinite, where,
  max, all) that the fused op replaces and equals bit for bit;
- copy: ``dst.copy_(src)`` of the same tensors, the bandwidth yardstick: like the fused pass it
  reads and writes every byte once (a CPU also reads the destination's cache lines before
  writing them unless it streams the stores, so the in-place pass may beat 100% of copy);
- check only: the fused op at inv_scale 1.0, which reads without writing (reported, no target).

The scale alternates between 0.5 and 2.0 so that the values neither drift into subnormals
(slow on some CPUs) nor change between rounds. Targets: fused >= 2x faster than unfused, and
>= 70% of copy bandwidth. Prints a table of medians and writes JSON.

    make perf                                              # all benchmarks
    python tests/perf/bench_fused_unscale.py               # this one (from the repository root)
    python tests/perf/bench_fused_unscale.py --quick       # a smoke test in seconds, no JSON
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402

from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.heterogeneous.measure import native  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET_SPEEDUP = 2.0
TARGET_FRACTION_OF_COPY = 0.70
RESULTS = REPO / "tests" / "perf" / "results" / "fused_unscale.json"


def split(total, parts):
    """``parts`` sizes summing to ``total``, as even as possible."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def timed(fn):
    get_accelerator().synchronize()
    start = time.perf_counter()
    fn()
    get_accelerator().synchronize()
    return time.perf_counter() - start


def measure(dtype, elements, tensors, repeats, device):
    """Seconds per round of each contender for one dtype, and the bytes one pass moves."""
    generator = torch.Generator().manual_seed(0)
    sizes = split(elements, tensors)
    grads = [torch.randn(size, generator=generator).to(device=device, dtype=dtype) for size in sizes]
    copies = [torch.empty_like(grad) for grad in grads]
    scales = itertools.cycle((0.5, 2.0))

    contenders = {
        "fused": lambda: native.unscale_maxabs_(grads, next(scales)),
        "unfused": lambda: native.unscale_maxabs_reference_(grads, next(scales)),
        "copy": lambda: [dst.copy_(src) for dst, src in zip(copies, grads)],
        "check_only": lambda: native.unscale_maxabs_(grads, 1.0),
    }
    times = {name: [] for name in contenders}
    for name, fn in contenders.items():  # warm-up: page faults, thread pools, allocator
        fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            times[name].append(timed(fn))
    return times, 2 * sum(grad.numel() * grad.element_size() for grad in grads)


def run(elements, tensors, repeats, dtypes, output):
    device = get_accelerator().current_device_name()
    rows = []
    for name in dtypes:
        times, pass_bytes = measure(DTYPES[name], elements, tensors, repeats, device)
        median = {contender: statistics.median(values) for contender, values in times.items()}
        speedup = median["unfused"] / median["fused"]
        fraction = median["copy"] / median["fused"]  # both move pass_bytes
        rows.append({
            "dtype": name, "median_s": median, "best_s": {contender: min(values)
                                                          for contender, values in times.items()},
            "fused_gb_per_s": pass_bytes / median["fused"] / 1e9,
            "copy_gb_per_s": pass_bytes / median["copy"] / 1e9, "speedup_over_unfused": speedup,
            "fraction_of_copy_bandwidth": fraction,
            "meets_targets": speedup >= TARGET_SPEEDUP and fraction >= TARGET_FRACTION_OF_COPY
        })
    report = {
        "workload": f"{elements} elements in {tensors} tensors per dtype, on {device}",
        "device": device, "elements": elements, "tensors": tensors, "repeats": repeats,
        "torch_threads": torch.get_num_threads(), "native_op": native.native_op_status(),
        "target_speedup": TARGET_SPEEDUP, "target_fraction_of_copy_bandwidth": TARGET_FRACTION_OF_COPY,
        "dtypes": rows
    }
    print_table(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        print(f"JSON written to {os.path.relpath(output, REPO)}")
    return report


def print_table(report):
    print(f"\nfused unscale: {report['workload']}, {report['torch_threads']} torch threads, "
          f"native op {report['native_op']}, medians of {report['repeats']}")
    print(f"targets: speedup >= {report['target_speedup']:.0f}x over unfused, "
          f">= {report['target_fraction_of_copy_bandwidth']:.0%} of copy bandwidth")
    print(f"{'dtype':>8}  {'fused ms':>8}  {'unfused ms':>10}  {'copy ms':>7}  {'check ms':>8}  {'speedup':>7}  "
          f"{'fused GB/s':>10}  {'copy GB/s':>9}  {'of copy':>7}  targets")
    for row in report["dtypes"]:
        ms = {contender: 1e3 * seconds for contender, seconds in row["median_s"].items()}
        print(f"{row['dtype']:>8}  {ms['fused']:>8.2f}  {ms['unfused']:>10.2f}  {ms['copy']:>7.2f}  "
              f"{ms['check_only']:>8.2f}  {row['speedup_over_unfused']:>6.1f}x  {row['fused_gb_per_s']:>10.2f}  "
              f"{row['copy_gb_per_s']:>9.2f}  {row['fraction_of_copy_bandwidth']:>7.0%}  "
              f"{'met' if row['meets_targets'] else 'MISSED'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=100_000_000, help="elements per dtype, in all tensors")
    parser.add_argument("--tensors", type=int, default=64, help="how many tensors the elements are split into")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds; the table shows medians")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--quick", action="store_true",
                        help="a tiny size (64K elements, 8 tensors, 3 rounds) to smoke-test the script; "
                        "writes JSON only to an explicit --output")
    parser.add_argument("--output", type=Path, default=None, help=f"JSON path (default {RESULTS.relative_to(REPO)})")
    args = parser.parse_args()
    if args.quick:
        args.elements, args.tensors, args.repeats = 1 << 16, 8, 3
    output = args.output if args.output is not None or args.quick else RESULTS
    os.chdir(REPO)
    run(args.elements, args.tensors, args.repeats, args.dtypes, output)
