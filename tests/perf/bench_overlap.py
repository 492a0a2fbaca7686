# SPDX-License-Identifier: Apache-2.0
"""``communication.overlap``: ZeRO-1/2's hierarchical gradient reduction during the backward vs after
each full bucket, beside upstream's flat all-reduce, on the emulated 2 x 2 cluster.

The cluster and the model are bench_communication.py's (``scripts/emulated_cluster.py``: 2 hosts x 2
ranks, ``tbf``-shaped links; the tiny GPT at bench size, fp32, AdamW, one torch thread per rank),
with what overlap needs and the issue's share scenario asks for:

- the links at ``RATE_MBIT`` (177 Mbit/s): the rate at which upstream's flat ZeRO-2 spends about 55%
  of its step in communication, as a data-parallel step of a 1.3 B-parameter GPT on two nodes of 8
  H100 joined by 100 Gbit/s does (docs/design/communication-plan.md, section 4: flat moves 7.94 MB
  each way per step, compute at micro-batch 12 takes about 0.29 s, and communication / compute = 1.22
  gives 8 x 7.94e6 / (1.22 x 0.294) bit/s);
- micro-batch ``MICRO_BATCH`` (12) per rank;
- ``reduce_bucket_size`` ``BUCKET`` (131072 elements, 0.5 MB: 7 buckets), set for every mode, so that
  there are buckets to overlap (the link-aware size at this rate is the model in one bucket);
- ZeRO-1 with ``overlap_comm: true`` in every mode (without it ZeRO-1 reduces after the backward).

With ``--dilation S`` every rank computes at speed S by time dilation, which leaves the cores to the
communication threads as a GPU node's compute does (``emulation.dilation_clock`` ``own`` by default:
each rank's own compute is stretched, not its waits for a core the other ranks hold; ``--dilation-clock
elapsed`` stretches those too); the compute is then 1/S times longer, so the rate that gives flat
ZeRO-2 the same 50-60% share is found by measuring flat: at S = 0.25 with ``own``, 100 Mbit/s (52%;
with a first version of the clock, 55% there, 68% at 60 Mbit/s and 61% at 90).

One launch trains, per ZeRO stage and repeat, one engine per mode from the same weights on the same
samples (``comm_train.py``, the order alternating by repeat): ``flat`` (upstream's reduction),
``sync`` (the fork's hierarchical reduction, ``overlap: false``), ``hier`` (``overlap: "auto"``) and
``coded`` (``hier`` with ``compress_inter_host: "lossless"``, bitwise equal to ``sync``); ZeRO-1/2 also
``fwd-gather`` (``hier`` with ``overlap_parameter_gather: true``) and ``fwd-coded`` (that with ``coded``'s
coding), bitwise equal to ``sync`` too.
Per mode: slow-link bytes per step (``tc`` counters), step time, the exposed communication (the main
thread's time in collectives and in waits for the background reduction, the comm clock), its split
over the forward, the backward and the step, and its share of the step, and the share the heterogeneous profiler reports for the same steps (its
``communication_share``: transfer plus waits, over the slowest rank's step time). ``hier`` must be
bitwise equal to ``sync`` (recorded per repeat).

    python tests/perf/bench_overlap.py           # ~5 min, root; JSON in tests/perf/results/overlap.json
    python tests/perf/bench_overlap.py --quick   # ZeRO-2, one repeat
    python tests/perf/bench_overlap.py --quick --stages 3   # ZeRO-3 (with hpZ), one repeat
    python tests/perf/bench_overlap.py --stages 2,3 --micro-batch 36 --rate 100   # 3x the compute, flat ZeRO-2 at ~52%
    python tests/perf/bench_overlap.py --stages 2,3 --rate 100 --dilation 0.25   # cores left to communication
"""

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "scripts"), str(REPO / "tests" / "perf")]

import bench_communication as bc  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "overlap.json"
RATE_MBIT = 177
MICRO_BATCH = 12
BUCKET = 131072
MODES = ("flat", "sync", "hier", "coded")
"""``coded``: ``hier`` with ``compress_inter_host: "lossless"`` (bitwise equal to ``sync`` too)."""
ZERO12_MODES = MODES + ("fwd-gather", "fwd-coded")
"""ZeRO-1/2 also runs ``hier`` with the parameter gather after the step moved into the next forward
(``fwd-gather``: ``communication.overlap_parameter_gather``, opt-in), and that with ``coded``'s
lossless coding (``fwd-coded``), both bitwise equal to ``sync``."""
ZERO3_MODES = MODES + ("one-chunk", "gather-all", "hpz")
"""ZeRO-3 also runs the fork with each gather's host-shard refresh in one all-to-all waited for as
a whole (``one-chunk``: ``hier`` without the refresh in chunks), the fork without host shards
(``gather-all``: ``hier`` with ``zero3_host_shards: false``, parameter gathers over every rank) and
upstream's hpZ
(``zero_hpz_partition_size`` 2: the flat reduction, backward gathers from a secondary copy inside
the host), last in each repeat (``comm_train.py``)."""
FULL = dict(stages=(1, 2, 3), repeats=3, warmup=1, short=1, long=4)
QUICK = dict(stages=(2, ), repeats=1, warmup=1, short=1, long=3)


def modes_of(stage):
    return ZERO3_MODES if stage == 3 else ZERO12_MODES


def summarise(stage, marks, results, repeats, short, long):
    """Medians per mode and the ratios the table prints."""
    row = {"zero_stage": stage}
    for mode in modes_of(stage):
        per_repeat = []
        for repeat in range(repeats):
            tag = f"zero{stage}-{mode}-r{repeat}"
            runs = [result["runs"][tag] for result in results]
            step = runs[0]["seconds"] / runs[0]["long_steps"]
            comm = sum(run["comm_seconds"] / run["long_steps"] for run in runs) / len(runs)
            link = bc.step_bytes([marks[f"{tag}-{x}"][1] for x in "abc"], short, long)
            profiled = runs[0].get("profiler") or {}
            phases = {phase: sum(run["comm_seconds_by_phase"][phase] / run["long_steps"] for run in runs) / len(runs)
                      for phase in ("forward", "backward", "step")}
            per_repeat.append({"step_time_s": step, "comm_time_s": comm, "comm_share": comm / step,
                               **{f"comm_{phase}_s": seconds for phase, seconds in phases.items()},
                               "profiler_share": profiled.get("communication_share"),
                               "slow_link_bytes": link, "overlapped": all(run.get("overlapped") for run in runs),
                               "hierarchical": all(run["hierarchical"] for run in runs)})
        row[mode] = {key: bc.median([r[key] for r in per_repeat])
                     for key in ("step_time_s", "comm_time_s", "comm_share", "slow_link_bytes", "profiler_share",
                                 "comm_forward_s", "comm_backward_s", "comm_step_s")}
        row[mode].update(repeats=per_repeat, overlapped=all(r["overlapped"] for r in per_repeat),
                         hierarchical=all(r["hierarchical"] for r in per_repeat))
    row["bitwise_overlap_vs_sync"] = all(result["runs"][f"zero{stage}-hier-r{r}"].get("bitwise_vs_sync")
                                         for result in results for r in range(repeats))
    row["step_time_vs_sync"] = row["hier"]["step_time_s"] / row["sync"]["step_time_s"]
    row["step_time_vs_flat"] = row["hier"]["step_time_s"] / row["flat"]["step_time_s"]
    row["exposed_comm_vs_sync"] = row["hier"]["comm_time_s"] / row["sync"]["comm_time_s"]
    row["bitwise_coded_vs_sync"] = all(result["runs"][f"zero{stage}-coded-r{r}"].get("bitwise_vs_sync")
                                       for result in results for r in range(repeats))
    row["step_time_coded_vs_hier"] = row["coded"]["step_time_s"] / row["hier"]["step_time_s"]
    row["bytes_coded_vs_hier"] = row["coded"]["slow_link_bytes"] / row["hier"]["slow_link_bytes"]
    if "fwd-gather" in row:  # the parameter gather during the next forward against the gather in the step
        row["bitwise_fwd_gather_vs_sync"] = all(
            result["runs"][f"zero{stage}-fwd-gather-r{r}"].get("bitwise_vs_sync") for result in results
            for r in range(repeats))
        row["step_time_fwd_gather_vs_hier"] = row["fwd-gather"]["step_time_s"] / row["hier"]["step_time_s"]
        row["exposed_comm_fwd_gather_vs_hier"] = row["fwd-gather"]["comm_time_s"] / row["hier"]["comm_time_s"]
        row["bitwise_fwd_coded_vs_sync"] = all(
            result["runs"][f"zero{stage}-fwd-coded-r{r}"].get("bitwise_vs_sync") for result in results
            for r in range(repeats))
        row["step_time_fwd_coded_vs_hier"] = row["fwd-coded"]["step_time_s"] / row["hier"]["step_time_s"]
    if "one-chunk" in row:  # the host-shard refresh in chunks against one all-to-all per gather
        row["bitwise_chunks_vs_one_chunk"] = all(
            result["runs"][f"zero{stage}-hier-r{r}"].get("bitwise_vs_one_chunk") for result in results
            for r in range(repeats))
        row["step_time_vs_one_chunk"] = row["hier"]["step_time_s"] / row["one-chunk"]["step_time_s"]
        row["exposed_forward_vs_one_chunk"] = row["hier"]["comm_forward_s"] / row["one-chunk"]["comm_forward_s"]
    return row


def run(quick=False, stages=None, rate_mbit=RATE_MBIT, micro_batch=MICRO_BATCH, dilation=0.0, clock="own"):
    plan = dict(FULL, **(QUICK if quick else {}))
    if stages:
        plan["stages"] = stages
    load_start = [round(x, 2) for x in os.getloadavg()]
    began = time.monotonic()
    scenario = bc.Scenario(f"2x2 at {rate_mbit} Mbit/s", (2, 2), (rate_mbit, rate_mbit), plan["stages"])
    progress = bc.Progress(sum(len(modes_of(stage)) for stage in plan["stages"]) * plan["repeats"])
    marks, results, launch = bc.run_scenario(
        scenario, plan["stages"], plan["repeats"], plan["warmup"], plan["short"], plan["long"],
        micro_batch=micro_batch,
        extra=["--modes", ",".join(ZERO3_MODES + ("fwd-gather", "fwd-coded")), "--reduce-bucket", BUCKET,
               "--overlap-comm-stages", "1", "--profile", "--dilation", dilation, "--dilation-clock", clock],
        progress=progress)
    report = {"quick": quick, "rate_mbit": rate_mbit, "micro_batch_per_rank": micro_batch, "dilation": dilation,
              "dilation_clock": clock if dilation else None,
              "reduce_bucket_size": BUCKET, "repeats": plan["repeats"], "launch": launch,
              "rows": [summarise(stage, marks, results, plan["repeats"], plan["short"], plan["long"])
                       for stage in plan["stages"]]}
    out = RESULTS if (rate_mbit, micro_batch, dilation) == (RATE_MBIT, MICRO_BATCH, 0.0) else \
        RESULTS.with_name(f"overlap-{rate_mbit}mbit-mb{micro_batch}{f'-dilation{dilation:g}' if dilation else ''}"
                             f"{'-elapsed' if dilation and clock == 'elapsed' else ''}.json")
    return bc.finish_report(report, began, load_start, print_table, out)


def print_table(report):
    dilation = report.get("dilation")
    dilated = f", every rank dilated to speed {dilation:g} ({report['dilation_clock']} clock)" if dilation else ""
    print(f"\noverlap: 2 hosts x 2 ranks at {report['rate_mbit']} Mbit/s, tiny GPT, micro-batch "
          f"{report['micro_batch_per_rank']}{dilated}, reduce_bucket_size {report['reduce_bucket_size']}, median of "
          f"{report['repeats']} repeat(s), {report['elapsed_s']:.0f} s")
    print(f"{'ZeRO':>4}  {'mode':<10} {'step ms':>8} {'exposed comm ms':>16} {'share':>6} {'profiler':>9} "
          f"{'slow-link MB':>13}  {'exposed in forward/backward/step ms':>35}")
    for row in report["rows"]:
        for mode in modes_of(row["zero_stage"]):
            m = row[mode]
            print(f"{row['zero_stage']:>4}  {mode:<10} {1e3 * m['step_time_s']:>8.0f} {1e3 * m['comm_time_s']:>16.0f} "
                  f"{m['comm_share']:>6.0%} {m['profiler_share']:>9.0%} {m['slow_link_bytes'] / 1e6:>13.2f}"
                  f"  {1e3 * m['comm_forward_s']:>11.0f} {1e3 * m['comm_backward_s']:>11.0f} {1e3 * m['comm_step_s']:>11.0f}"
                  f"{'  (overlapped)' if m['overlapped'] else ''}")
        print(f"      overlap vs sync: step x{row['step_time_vs_sync']:.2f}, exposed comm "
              f"x{row['exposed_comm_vs_sync']:.2f}; vs flat: step x{row['step_time_vs_flat']:.2f}; bitwise equal to "
              f"sync: {'yes' if row['bitwise_overlap_vs_sync'] else 'NO'}")
        print(f"      coded vs hier: step x{row['step_time_coded_vs_hier']:.2f}, slow-link bytes "
              f"x{row['bytes_coded_vs_hier']:.3f}; bitwise equal to sync: {'yes' if row['bitwise_coded_vs_sync'] else 'NO'}")
        if "fwd-gather" in row:
            print(f"      fwd-gather vs hier: step x{row['step_time_fwd_gather_vs_hier']:.2f}, exposed comm "
                  f"x{row['exposed_comm_fwd_gather_vs_hier']:.2f}; bitwise equal to sync: "
                  f"{'yes' if row['bitwise_fwd_gather_vs_sync'] else 'NO'}")
            print(f"      fwd-coded vs hier: step x{row['step_time_fwd_coded_vs_hier']:.2f}; bitwise equal to sync: "
                  f"{'yes' if row['bitwise_fwd_coded_vs_sync'] else 'NO'}")
        if "one-chunk" in row:
            print(f"      refresh in chunks vs one-chunk: step x{row['step_time_vs_one_chunk']:.2f}, exposed in forward "
                  f"x{row['exposed_forward_vs_one_chunk']:.2f}; bitwise equal: "
                  f"{'yes' if row['bitwise_chunks_vs_one_chunk'] else 'NO'}")
    print(f"load average start/end {report['load_average']['start']} / {report['load_average']['end']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="ZeRO-2, one repeat")
    parser.add_argument("--stages", default=None, help="ZeRO stages to run, e.g. 3 (default: 1,2,3; --quick: 2)")
    parser.add_argument("--rate", type=int, default=RATE_MBIT,
                        help=f"link rate in Mbit/s (default {RATE_MBIT}; another rate or micro-batch writes "
                             "overlap-<rate>mbit-mb<micro-batch>.json)")
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                        help=f"micro-batch per rank (default {MICRO_BATCH}): a longer forward and backward")
    parser.add_argument("--dilation", type=float, default=0.0,
                        help="every rank emulated at this speed by time dilation (its compute stretched to 1/speed "
                             "times, leaving the cores to communication, as a GPU's compute leaves its host's)")
    parser.add_argument("--dilation-clock", choices=("own", "elapsed"), default="own",
                        help="emulation.dilation_clock with --dilation: stretch each rank's own compute (default: "
                             "its waits for a core that other ranks hold left out) or its elapsed time")
    arguments = parser.parse_args()
    os.chdir(REPO)
    run(arguments.quick, tuple(int(s) for s in arguments.stages.split(",")) if arguments.stages else None,
        arguments.rate, arguments.micro_batch, arguments.dilation, arguments.dilation_clock)