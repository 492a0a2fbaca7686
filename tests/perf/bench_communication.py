# SPDX-License-Identifier: Apache-2.0
"""Hierarchical gradient reduction vs upstream's flat all-reduce, on emulated multi-host clusters.

Upstream all-reduces ZeRO-1/2 gradient buckets over one flat data-parallel
group, so a slow link between hosts carries as much as any link inside a host; the fork's
``heterogeneous_config.communication.hierarchical_reduction`` (``"auto"``: on across hosts)
reduces inside each host first and sends between host leaders only the gradient slices the other
hosts' ranks own, then sends each host's updated parameter partitions across once
(``deepspeed/runtime/heterogeneous/comm/hierarchical.py``).

Clusters (``scripts/emulated_cluster.py``: network namespaces on a bridge, ``tbf``-shaped links,
every host started by the real ``deepspeed`` launcher without ssh), the small GPT of
examples/tiny_gpt (bench size, 0.86 M parameters, 3.4 MB of fp32 gradients), micro-batch 4 per
rank, fp32, AdamW, one torch thread per rank:

- ``2x2``: 2 hosts x 2 ranks, each host's link 200 Mbit/s; ZeRO-1, ZeRO-2 and ZeRO-3 (only its
  gradient reduce-scatter is hierarchical; its parameter gathers stay flat in both modes).
- ``3 hosts, 1/10``: 3 hosts x 2 ranks, links 200, 200 and 20 Mbit/s; ZeRO-2.
- ``2+1``: uneven hosts, 2 ranks and 1, links 200 Mbit/s; ZeRO-2.

In one launch per cluster every rank trains, for each stage and repeat, one engine of each mode
from the same weights on the same samples (``comm_train.py``, the order alternating by repeat):
``flat`` (``hierarchical_reduction: false``, upstream's reduction) and ``hier`` (``"auto"``). Both
run the fork with the uniform split, so the fork's comm clock times every collective in either
mode and the reduction is the only difference. Per mode and repeat:

- slow-link bytes per step: the ``tc -s`` byte counters of the slowest host's link (both
  directions; the last host on a tie), read at three marks around a short and a long segment of
  steps; the difference of the two segments over their step difference cancels start-up and the
  marks' own traffic (exact: the kernel's counters of the shaped qdiscs);
- step time: the long segment's wall time over its steps (every rank aligned at its end);
- communication time: each rank's time inside collectives in the long segment per step (the
  fork's comm clock; waiting for peers included), the ranks' mean; share: over the step time.

Medians over the repeats. Targets against flat (reported, not asserted): slow-link bytes and
communication time each >= 40% lower, step time >= 25% lower; fp32 final parameters equal up to
summation order (largest difference <= 1e-5, the multi-host exactness tests' tolerance). ``flat``
puts the same bytes on the links as the fork switched off (``comm_train.py --modes flat,off``
measured 15.883 and 15.882 MB per step on 2x2, ZeRO-2).

Beside the measurement the table prints the byte reduction that ``link_bytes_model`` predicts
(flat rings vs the fork's exchange of owned slices and partitions; the counters match it within a
few % of frame headers).

The machine's other load changes step times, not bytes: the JSON records ``os.getloadavg()``.

    python tests/perf/bench_communication.py            # full run (7.5 min at low load), JSON in tests/perf/results/
    python tests/perf/bench_communication.py --quick    # smoke run (< 2 min): 2x2, ZeRO-2, 1 repeat
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "scripts")]

TRAIN = REPO / "tests" / "perf" / "comm_train.py"
RESULTS = REPO / "tests" / "perf" / "results" / "communication.json"
TARGETS = {"slow_link_bytes": 0.40, "comm_time": 0.40, "step_time": 0.25}
EXACT_ATOL = 1e-5
MICRO_BATCH = 4


@dataclass(frozen=True)
class Scenario:
    name: str
    ranks: Tuple[int, ...]
    """Ranks per host."""
    rates_mbit: Tuple[float, ...]
    """Link rate per host."""
    stages: Tuple[int, ...]
    steps: Optional[Tuple[int, int, int]] = None
    """(warm-up, short, long) steps of the full run, where they differ from FULL's."""

    @property
    def slow_host(self):
        """The host behind the slowest link (the last one on a tie)."""
        slowest = min(self.rates_mbit)
        return max(h for h, rate in enumerate(self.rates_mbit) if rate == slowest)


SCENARIOS = {
    "2x2": Scenario("2x2", (2, 2), (200, 200), (1, 2, 3)),
    # A step moves ~8 MB each way over the 20 Mbit/s link (~3.5 s): fewer steps, the same bytes.
    "3hosts": Scenario("3 hosts, 1/10", (2, 2, 2), (200, 200, 20), (2,), steps=(1, 1, 3)),
    "2+1": Scenario("2+1", (2, 1), (200, 200), (2,)),
}
FULL = dict(scenarios=("2x2", "3hosts", "2+1"), repeats=3, warmup=2, short=2, long=8)
QUICK = dict(scenarios=("2x2",), stages=(2,), repeats=1, warmup=1, short=1, long=3)


# -- pure parts ---------------------------------------------------------------------------------


def step_bytes(counters, short, long):
    """Bytes of one training step from the counters at the three marks: (c - b) - (b - a) is what
    LONG - SHORT steps add, every per-segment cost cancelled."""
    a, b, c = counters
    return ((c - b) - (b - a)) / (long - short)


def link_bytes_model(ranks, numel_bytes, hierarchical, host):
    """Bytes a ZeRO-1/2 step puts on ``host``'s link (both directions), for N bytes of gradients
    on P ranks, P_h of them on the host, H hosts:

    - flat (upstream): gloo's rings over the ranks in rank order (hosts numbered host by host, as
      DeepSpeed's launcher does, so one ring edge leaves every host and one enters it): the
      gradient all-reduce puts 2 (P - 1) / P * N on every edge, the parameter all-gather
      (P - 1) / P * N;
    - hierarchical: the host leaders exchange only the slices the other hosts' ranks own (out
      N (P - P_h) / P, in (H - 1) N P_h / P), and each host's updated partitions cross once (out
      (H - 1) N P_h / P, in N (P - P_h) / P).
    """
    count, hosts, mine = sum(ranks), len(ranks), ranks[host]
    if not hierarchical:
        return 2 * (2 * (count - 1) / count + (count - 1) / count) * numel_bytes  # out and in
    return 2 * ((count - mine) / count + (hosts - 1) * mine / count) * numel_bytes


def median(values):
    return statistics.median(values)


class Progress:
    """One line per launch and per finished run (a mode of one stage and repeat, as the marks show
    it), with the seconds since the benchmark began and an estimate of what is left: the runs to
    come at the mean time of a run after a launch's first, and each launch to come at its first
    run's time (start-up included)."""

    def __init__(self, total_runs, total_launches=1):
        self.total, self.total_launches = total_runs, total_launches
        self.done, self.launches, self.began = 0, 0, time.monotonic()
        self.first_runs, self.later_runs = [], []
        self.launch_began = self.last_end = None

    def elapsed(self):
        return time.monotonic() - self.began

    def say(self, text):
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def launch_started(self, text):
        self.launches += 1
        self.launch_began, self.last_end = time.monotonic(), None
        self.say(f"launch {self.launches}/{self.total_launches}: {text}")

    def seconds_left(self):
        first = statistics.fmean(self.first_runs)
        later = statistics.fmean(self.later_runs) if self.later_runs else first
        launches_left = max(0, self.total_launches - self.launches)
        return max(0.0, (self.total - self.done) * later + launches_left * (first - later))

    def run_finished(self, what, detail):
        now = time.monotonic()
        self.done += 1
        if self.last_end is None:
            self.first_runs.append(now - (self.launch_began or self.began))
        else:
            self.later_runs.append(now - self.last_end)
        self.last_end = now
        self.say(f"run {self.done}/{self.total} {what}: {detail}"
                 + (f"; about {self.seconds_left():.0f} s left" if self.done < self.total else "; measurements done"))


def reduction(flat, hier):
    """How much lower ``hier`` is than ``flat`` (0.4: 40% lower)."""
    return 1.0 - hier / flat if flat else float("nan")


def summarise(scenario, stage, marks, ranks_results, repeats, short, long, gradient_bytes):
    """One table row from the counters at the marks and every rank's results."""
    modes = {}
    for mode in ("flat", "hier"):
        per_repeat = []
        for repeat in range(repeats):
            tag = f"zero{stage}-{mode}-r{repeat}"
            links = [step_bytes([marks[f"{tag}-{x}"][h] for x in "abc"], short, long)
                     for h in range(len(scenario.ranks))]
            runs = [result["runs"][tag] for result in ranks_results]
            step_time = runs[0]["seconds"] / runs[0]["long_steps"]
            comm_time = statistics.fmean(run["comm_seconds"] / run["long_steps"] for run in runs)
            per_repeat.append({"link_bytes": links, "slow_link_bytes": links[scenario.slow_host],
                               "step_time_s": step_time, "comm_time_s": comm_time,
                               "comm_share": comm_time / step_time,
                               "hierarchical": all(run["hierarchical"] for run in runs),
                               "scheme": runs[0]["scheme"], "losses": runs[0]["losses"]})
        modes[mode] = {
            "repeats": per_repeat,
            "slow_link_bytes": median([r["slow_link_bytes"] for r in per_repeat]),
            "step_time_s": median([r["step_time_s"] for r in per_repeat]),
            "comm_time_s": median([r["comm_time_s"] for r in per_repeat]),
            "comm_share": median([r["comm_share"] for r in per_repeat]),
            "model_slow_link_bytes": (link_bytes_model(scenario.ranks, gradient_bytes, mode == "hier", scenario.slow_host)
                                      if stage < 3 else None),
        }
    flat, hier = modes["flat"], modes["hier"]
    diffs = [result["runs"][f"zero{stage}-hier-r{r}"]["max_param_diff"] for result in ranks_results
             for r in range(repeats)]
    loss_diff = max(abs(x - y) for r in range(repeats)
                    for x, y in zip(flat["repeats"][r]["losses"], hier["repeats"][r]["losses"]))
    lower = {"slow_link_bytes": reduction(flat["slow_link_bytes"], hier["slow_link_bytes"]),
             "comm_time": reduction(flat["comm_time_s"], hier["comm_time_s"]),
             "step_time": reduction(flat["step_time_s"], hier["step_time_s"])}
    return {
        "scenario": scenario.name, "ranks_per_host": list(scenario.ranks), "rates_mbit": list(scenario.rates_mbit),
        "slow_host": scenario.slow_host, "zero_stage": stage, "flat": flat, "hier": hier,
        "hierarchical_in_force": all(r["hierarchical"] for r in hier["repeats"])
        and not any(r["hierarchical"] for r in flat["repeats"]),
        "scheme": hier["repeats"][0]["scheme"],
        "lower": lower,
        "model_lower": (reduction(flat["model_slow_link_bytes"], hier["model_slow_link_bytes"]) if stage < 3 else None),
        "meets": {key: lower[key] >= target for key, target in TARGETS.items()},
        "max_param_diff": max(diffs), "max_loss_diff": loss_diff, "exact": max(diffs) <= EXACT_ATOL,
    }


# -- the edge: clusters -------------------------------------------------------------------------


def gradient_bytes():
    """fp32 bytes of the benchmark model's gradients."""
    from examples.tiny_gpt import GPT, GPTConfig
    return 4 * sum(p.numel() for p in GPT(GPTConfig.bench(), seed=0).parameters())


def launch_answering_marks(cluster, script, args, out, read_counters, timeout, on_mark=None):
    """Run ``script`` with the deepspeed launcher on every host of ``cluster`` while this thread
    answers each ``<out>/mark-<name>`` file the ranks write with ``read_counters(host)`` for every
    host (then ``ack-<name>``); returns ``(marks, run)``: the counters by mark name and the launch.
    ``on_mark(name, marks, seen)``, if given, is called after each answer (``seen``: this thread's
    ``time.monotonic()`` when it found each mark)."""
    import harness

    marks, seen, holder = {}, {}, {}
    launcher = threading.Thread(target=lambda: holder.update(run=cluster.launch_deepspeed(
        script, args, env=harness.fork_environment(), timeout=timeout, master_port=harness.free_port(),
        cwd=REPO)), daemon=True)
    launcher.start()
    while launcher.is_alive():
        for path in sorted(out.glob("mark-*")):
            name = path.name[len("mark-"):]
            if name not in marks:
                seen[name] = time.monotonic()
                marks[name] = [read_counters(host) for host in range(len(cluster.specs))]
                (out / f"ack-{name}").write_text("")
                if on_mark is not None:
                    on_mark(name, marks, seen)
        time.sleep(0.005)
    return marks, holder.get("run")


def progress_at_marks(progress, scenario, short, long):
    """An ``on_mark`` that reports each run when its last mark (``<tag>-c``) is answered: its step
    time between marks b and c (as this process saw them) and its slow-link bytes per step."""

    def on_mark(name, marks, seen):
        if progress is None or not name.endswith("-c"):
            return
        tag, host = name[:-len("-c")], scenario.slow_host
        step_s = (seen[name] - seen[f"{tag}-b"]) / long
        link = step_bytes([marks[f"{tag}-{x}"][host] for x in "abc"], short, long)
        progress.run_finished(f"{scenario.name} {tag}", f"step {1e3 * step_s:.0f} ms, slow-link {link / 1e6:.2f} MB/step")

    return on_mark


def run_scenario(scenario, stages, repeats, warmup, short, long, timeout=900, micro_batch=MICRO_BATCH, extra=(),
                 progress=None):
    """Launch comm_train.py across the emulated hosts; answer its marks with the link counters.
    ``extra``: more comm_train.py arguments (``--modes``, ``--reduce-bucket``); ``progress``: a
    Progress that gets a line per finished run."""
    import tempfile

    import emulated_cluster as ec

    if progress is not None:
        progress.launch_started(f"{scenario.name} ({' + '.join(map(str, scenario.ranks))} ranks), ZeRO "
                                f"{','.join(map(str, stages))}, {repeats} repeat(s)")

    specs = [ec.HostSpec(ranks=r, rate_mbit=rate) for r, rate in zip(scenario.ranks, scenario.rates_mbit)]
    with tempfile.TemporaryDirectory(prefix="bench_communication_") as folder, ec.EmulatedCluster(specs) as cluster:
        out = Path(folder)
        args = ["--out", out, "--stages", ",".join(map(str, stages)), "--repeats", repeats, "--micro-batch",
                micro_batch, "--warmup", warmup, "--short", short, "--long", long, *extra]
        launched = time.time()
        marks, run = launch_answering_marks(cluster, TRAIN, args, out, lambda h: cluster.link_counters(h).total,
                                            timeout, on_mark=progress_at_marks(progress, scenario, short, long))
        if run is None or not run.ok:
            raise RuntimeError(f"{scenario.name}: the training run failed:\n"
                               f"{run.describe() if run else 'no result'}")
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(sum(scenario.ranks))]
    launch = {"start_up_s": max(r["times"]["initialised"] for r in results) - launched,
              "build_s": median([entry["build_seconds"] for r in results for entry in r["runs"].values()]),
              "wall_s": max(r["times"]["done"] for r in results) - launched}
    return marks, results, launch


def run(quick=False, scenarios=None):
    plan = dict(FULL, **(QUICK if quick else {}))
    if scenarios:
        plan["scenarios"] = scenarios
    load_start = [round(x, 2) for x in os.getloadavg()]
    began = time.monotonic()
    numel_bytes = gradient_bytes()
    report = {"quick": quick, "model": "tiny GPT bench size (seq 128, d_model 128, 4 layers), fp32, AdamW",
              "gradient_bytes": numel_bytes, "micro_batch_per_rank": MICRO_BATCH,
              "repeats": plan["repeats"],
              "targets": TARGETS, "exact_atol": EXACT_ATOL, "rows": []}
    # comm_train.py runs both modes (flat, hier) per stage and repeat.
    progress = Progress(sum(2 * len(plan.get("stages", SCENARIOS[key].stages)) * plan["repeats"]
                            for key in plan["scenarios"]), total_launches=len(plan["scenarios"]))
    for key in plan["scenarios"]:
        scenario = SCENARIOS[key]
        stages = plan.get("stages", scenario.stages)
        warmup, short, long = (scenario.steps if scenario.steps and not quick
                               else (plan["warmup"], plan["short"], plan["long"]))
        marks, results, launch = run_scenario(scenario, stages, plan["repeats"], warmup, short, long,
                                              progress=progress)
        for stage in stages:
            row = summarise(scenario, stage, marks, results, plan["repeats"], short, long, numel_bytes)
            row.update(steps={"warmup": warmup, "short": short, "long": long}, launch=launch)
            report["rows"].append(row)
    return finish_report(report, began, load_start, print_table, RESULTS)


def finish_report(report, began, load_start, printer, path):
    """Add the run's duration and load to ``report``, print it with ``printer``, write it to ``path``."""
    report["elapsed_s"] = time.monotonic() - began
    report["load_average"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    printer(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"JSON written to {path.relative_to(REPO)}")
    return report


def print_table(report):
    mb = 1e6
    print(f"\ncommunication: flat (upstream's all-reduce) vs hierarchical, tiny GPT "
          f"({report['gradient_bytes'] / mb:.1f} MB of fp32 gradients), median of {report['repeats']} repeat(s)"
          f"{' (--quick: a smoke run)' if report['quick'] else ''}, {report['elapsed_s']:.0f} s")
    print(f"{'cluster':<14} {'ZeRO':>4}  {'slow-link MB/step':>19}  {'model':>5}  "
          f"{'comm ms (share)':>27}  {'step ms':>15}  {'lower: bytes':>12}{'comm':>7}{'step':>7}  exact")
    for row in report["rows"]:
        flat, hier, lower = row["flat"], row["hier"], row["lower"]
        marks = {key: ("" if met else "!") for key, met in row["meets"].items()}
        print(f"{row['scenario']:<14} {row['zero_stage']:>4}  "
              f"{flat['slow_link_bytes'] / mb:>9.2f} -> {hier['slow_link_bytes'] / mb:>6.2f}  "
              f"{'-' if row['model_lower'] is None else format(row['model_lower'], '.0%'):>5}  "
              f"{1e3 * flat['comm_time_s']:>6.0f} ({flat['comm_share']:>3.0%}) -> {1e3 * hier['comm_time_s']:>5.0f} "
              f"({hier['comm_share']:>3.0%})  {1e3 * flat['step_time_s']:>6.0f} -> {1e3 * hier['step_time_s']:>5.0f}  "
              f"{lower['slow_link_bytes']:>11.0%}{marks['slow_link_bytes']:1}{lower['comm_time']:>6.0%}"
              f"{marks['comm_time']:1}{lower['step_time']:>6.0%}{marks['step_time']:1}  "
              f"{'yes' if row['exact'] else 'NO'} ({row['max_param_diff']:.1e})"
              f"{'' if row['hierarchical_in_force'] else '  hierarchical reduction NOT in force'}")
    missed = sum(not met for row in report["rows"] for met in row["meets"].values())
    total = sum(len(row["meets"]) for row in report["rows"])
    print(f"targets (lower than flat): bytes >= {TARGETS['slow_link_bytes']:.0%}, comm >= {TARGETS['comm_time']:.0%}, "
          f"step >= {TARGETS['step_time']:.0%}; met {total - missed} of {total} ('!': not met).\n'model': the "
          f"byte reduction link_bytes_model predicts for the slow link (flat rings vs the fork's exchange; ZeRO-1/2).\n"
          f"Load average start/end "
          f"{report['load_average']['start']} / {report['load_average']['end']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run (< 2 min): 2x2, ZeRO-2, one repeat")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), help="only these clusters")
    arguments = parser.parse_args()
    os.chdir(REPO)
    run(arguments.quick, arguments.scenarios)
