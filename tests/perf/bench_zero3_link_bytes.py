# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3's bytes on a slow link between hosts, per configuration, and what gloo's collectives cost.

Two questions, one launch on an emulated cluster (``scripts/emulated_cluster.py``: network
namespaces on a bridge, 2 hosts x 2 ranks, each host's link shaped to 200 Mbit/s by ``tbf``, every
host started by the real ``deepspeed`` launcher without ssh; ranks of one host talk over loopback,
so only traffic between hosts reaches the link counters). Every rank runs
``zero3_link_bytes_rank.py``: first the ZeRO-3 configurations, then the collectives.

(a) How many bytes a ZeRO-3 step puts on the link, and what changes that: backward re-gathers
(parameters the forward gathered and released, gathered again for backward), hpZ
(``zero_hpz_partition_size``: a secondary copy of the parameters partitioned inside each host, which
backward gathers from) and the fork's hierarchical gradient reduction. The small GPT of
examples/tiny_gpt (bench size, 842,496 parameters, N = 3.37 MB of fp32), micro-batch 4 per rank,
fp32, AdamW, the fork enabled with the uniform split in every row, one engine per configuration
from the same weights on the same samples:

- ``flat``: ``communication.hierarchical_reduction: false`` (upstream's reduce-scatter);
- ``reuse 0``: ``stage3_max_reuse_distance: 0``; ``prefetch 0``: ``stage3_prefetch_bucket_size: 0``
  (each module gathers its own parameters when it runs; both together force backward re-gathers);
- ``hpZ=2``: ``zero_hpz_partition_size: 2`` (the ranks of one host);
- ``hier``: ``hierarchical_reduction: "auto"`` (the fork's reduction across hosts,
  ``deepspeed/runtime/heterogeneous/comm/hierarchical.py``) with ``zero3_host_shards: false``;
- ``hier + host shards``: both ``"auto"`` (parameter gathers inside each host from each host's copy,
  ``comm/host_shards.py``);
- ``hier + host shards + lossless``: with ``compress_inter_host: "lossless"`` (the leaders' exchanges
  and the host-shard refresh coded bit for bit, ``comm/lossless.py``).

Slow-link bytes per step: the ``tc -s`` byte counters of host 1's link (both directions; the two
links carry the same bytes), read at marks around a segment of 1 step and one of 3 after 2 warm-up
steps (comm_train.py's marks, bench_communication.py's ``step_bytes``: (c - b) - (b - a) over the
step difference, start-up and the marks' own traffic cancelled). Backward re-gathers: each rank
records the collectives of the 3-step segment by phase (``collective_log.recording``); a backward
``all_gather_into_tensor`` is a re-gather, and its group says whether it crosses hosts (4 ranks) or
stays inside one (2). ``ms/step`` is for orientation only (the machine's load moves it, not the
bytes); nothing here asserts a time.

(b) What one gloo collective costs on the link: ``reduce_scatter_tensor``, ``all_reduce`` and
``all_gather_into_tensor`` (``deepspeed.comm``) on the world group, fp32 tensors of 1.05 and 4.19 MB
(the full tensor: a reduce-scatter's input, an all-gather's output), one call per unit between the
same marks (1 call, then 3). Reported: host 1's link bytes per call over the tensor's bytes, and
``ring``: what a ring moves across one host boundary (2 (P - 1) / P per pass, P = 4).

Latest measurement (full run, 2-core machine, torch 2.13.0+cpu; a rerun can differ, the JSON holds
its own numbers; the bytes repeat to ~0.1%):

- gloo's reduce-scatter costs an all-reduce's bytes: 3.147x / 3.141x the tensor (1.05 / 4.19 MB),
  as much as all_reduce's 3.146x / 3.141x (ratio 1.000), against 1.574x / 1.571x for
  all_gather_into_tensor (reduce-scatter / all-gather 2.000); a ring would move 1.5x for either
  (the gathers' extra ~5% are frame headers).
- A flat step moves 15.89 MB = 4.72 N: the forward's one coalesced all-gather (1.57 N) and the
  backward reduce-scatter (3.14 N), two thirds of the step's bytes.
- ``stage3_max_reuse_distance: 0`` alone does not cause re-gathers: 15.89 MB, none logged, because
  the prefetcher (bucket 5e7 elements, more than the model) keeps the parameters it fetched for
  backward; prefetch 0 alone neither (16.01 MB, the forward gathering module by module). Both
  together: 28 backward all-gathers per step, 3.50 MB on the 4-rank group, 21.84 MB (1.374x flat,
  +5.94 MB).
- hpZ=2 saves exactly the backward re-gathers, and only when they exist: alone 15.89 MB (1.000x,
  nothing to save); with reuse 0 + prefetch 0 its re-gathers run on the 2-rank group inside a host,
  16.01 MB, 5.83 MB less than flat's 21.84 and 1.0002x flat + prefetch 0 (the same forward gathers
  without re-gathers).
- hier (without host shards): 8.84 MB (0.556x flat): the gradients cross between the host leaders
  instead of in the flat reduce-scatter; its forward gathers and any re-gathers stay on the world
  group: with reuse 0 + prefetch 0 14.79 MB (0.930x, the same 28 re-gathers across hosts, +5.94 MB).
- hier + host shards (``zero3_host_shards``, the fork's default): 7.08 MB (0.445x flat, 2.10 N:
  1.05 N each way, half the refresh of the host shards, half the reduction); with reuse 0 +
  prefetch 0 also 7.08 MB (0.324x of flat's 21.83), the 28 re-gathers on the 2-rank groups. Its
  losses equal hier's bitwise and flat's within 4.8e-7.
- hier + host shards + lossless: 6.04 MB (0.380x flat, 1.79 N); with reuse 0 + prefetch 0 6.18 MB
  (0.283x of flat's 21.84); losses bitwise equal to the rows without coding.
- With the fork enabled ``stage3_param_persistence_threshold`` is 0 in every row (upstream's
  default 100000, ``zero3_settings.py``) and no parameter is persistent: every parameter travels
  in the gathers above.
- The hpZ rows run last (``CONFIGS``): upstream keeps the hpZ group in a module global that
  ``engine.destroy()`` does not clear, and later ZeRO-3 engines of the process take it whatever
  their own setting; run after them, hier + reuse 0 + prefetch 0 measured 8.96 MB with in-host
  re-gathers (an hpZ engine). The rank script refuses that order.

    python tests/perf/bench_zero3_link_bytes.py            # full run (85 s on 2 cores), JSON in tests/perf/results/
    python tests/perf/bench_zero3_link_bytes.py --quick    # smoke run (55 s): 7 configurations, one size
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "scripts"), str(REPO / "tests" / "perf")]

from bench_communication import gradient_bytes, launch_answering_marks, step_bytes  # noqa: E402
from zero3_link_bytes_rank import CONFIGS  # noqa: E402

RANK_SCRIPT = REPO / "tests" / "perf" / "zero3_link_bytes_rank.py"
RESULTS = REPO / "tests" / "perf" / "results" / "zero3_link_bytes.json"
RANKS = (2, 2)
RATE_MBIT = 200
SLOW_HOST = 1
"""Both links run at the same rate: the last host's, as bench_communication.py picks on a tie."""
MICRO_BATCH = 4
FULL = dict(configs=tuple(CONFIGS), sizes=(262144, 1048576), warmup=2, short=1, long=3)
QUICK = dict(configs=("flat", "flat-r0p0", "hier", "shards", "shards-r0p0", "coded", "hpz2-r0p0"), sizes=(1048576, ))
"""Configurations run in CONFIGS' order whatever the order here: hpZ last (see CONFIGS)."""
RING_IDEAL = {"reduce_scatter_tensor": 1, "all_reduce": 2, "all_gather_into_tensor": 1}
"""A ring's bytes on one host's link (both directions) in units of 2 (P - 1) / P times the tensor."""


# -- pure parts ---------------------------------------------------------------------------------


def per_unit(marks, tag, host, short, long):
    """(sent, received) bytes of one step or call on ``host``'s link from the counters at the marks."""
    return tuple(step_bytes([marks[f"{tag}-{x}"][host][side] for x in "abc"], short, long) for side in (0, 1))


def regathers(log):
    """Backward parameter gathers per step from a rank's collective log: [{group, calls, bytes}]."""
    found = []
    for key, (calls, size) in log.items():
        phase, op, group = key.split("|")
        if phase == "backward" and op == "all_gather_into_tensor":
            found.append({"group": int(group[1:]), "calls": calls, "bytes": size})
    return sorted(found, key=lambda r: r["group"])


def summarise_zero3(marks, ranks, names, short, long, parameter_bytes):
    rows = []
    for name in names:
        mode, zero, label = CONFIGS[name]
        links = [per_unit(marks, name, host, short, long) for host in range(len(RANKS))]
        runs = [rank["zero3"][name] for rank in ranks]
        logs = [run["collectives_per_step"] for run in runs]
        rows.append({
            "name": name, "label": label, "mode": mode, "zero_optimization": dict({"stage": 3}, **zero),
            "link_bytes": [sum(link) for link in links], "link_sent_received": links,
            "slow_link_bytes": sum(links[SLOW_HOST]), "per_parameter_bytes": sum(links[SLOW_HOST]) / parameter_bytes,
            "step_time_s": runs[0]["seconds"] / runs[0]["long_steps"],
            "settings": runs[0]["settings"], "persistent_parameters": runs[0]["persistent_parameters"],
            "hpz_in_force": all(run["secondary_group_size"] == zero.get("zero_hpz_partition_size", 1) for run in runs),
            "hierarchical": all(run["hierarchical"] for run in runs),
            "host_shards": all(run["host_shards"] for run in runs),
            "backward_regathers": regathers(logs[0]),
            "same_regathers_on_every_rank": all(regathers(log) == regathers(logs[0]) for log in logs),
            "collectives_per_step_rank0": logs[0], "losses_rank0": runs[0]["losses"]})
    flat = next((row for row in rows if row["name"] == "flat"), rows[0])
    for row in rows:
        row["vs_flat"] = row["slow_link_bytes"] / flat["slow_link_bytes"]
    return rows


def summarise_collectives(marks, info, world_size):
    rows = []
    ring_unit = 2 * (world_size - 1) / world_size
    for tag, entry in info.items():
        sent, received = per_unit(marks, tag, SLOW_HOST, entry["short"], entry["long"])
        size = entry["tensor_bytes"]
        rows.append({"op": entry["op"], "numel": entry["numel"], "tensor_bytes": size, "sent": sent,
                     "received": received, "per_tensor": (sent + received) / size,
                     "ring_per_tensor": RING_IDEAL[entry["op"]] * ring_unit})
    return rows


def derived(zero3, collectives):
    """The comparisons the docstring states, from the rows that are there."""
    by_name = {row["name"]: row for row in zero3}
    facts = {}
    if "flat-r0p0" in by_name and "flat" in by_name:
        facts["regathers_add_bytes"] = by_name["flat-r0p0"]["slow_link_bytes"] - by_name["flat"]["slow_link_bytes"]
    if "flat-r0p0" in by_name and "hpz2-r0p0" in by_name:
        facts["hpz_saves_with_regathers"] = (by_name["flat-r0p0"]["slow_link_bytes"]
                                             - by_name["hpz2-r0p0"]["slow_link_bytes"])
    if "hpz2-r0p0" in by_name and "flat-p0" in by_name:
        facts["hpz_with_regathers_over_no_regathers"] = (by_name["hpz2-r0p0"]["slow_link_bytes"]
                                                         / by_name["flat-p0"]["slow_link_bytes"])
    if "hpz2" in by_name and "flat" in by_name:
        facts["hpz_saves_without_regathers"] = by_name["flat"]["slow_link_bytes"] - by_name["hpz2"]["slow_link_bytes"]
    # (row, the row it must equal bitwise): host shards only copy values, the coder gives back every bit
    for shards, hier in (("shards", "hier"), ("shards-r0p0", "hier-r0p0"), ("coded", "shards"),
                         ("coded-r0p0", "shards-r0p0")):
        if shards in by_name and "flat" in by_name:
            facts[f"{shards}_over_flat"] = by_name[shards]["slow_link_bytes"] / by_name["flat"]["slow_link_bytes"]
        if shards in by_name and "flat-r0p0" in by_name and shards.endswith("r0p0"):
            facts[f"{shards}_over_flat-r0p0"] = (by_name[shards]["slow_link_bytes"]
                                                 / by_name["flat-r0p0"]["slow_link_bytes"])
        if shards in by_name and hier in by_name:  # the same reduction, gathered inside the host: the same bits
            facts[f"{shards}_losses_equal_{hier}"] = by_name[shards]["losses_rank0"] == by_name[hier]["losses_rank0"]
        if shards in by_name and "flat" in by_name:
            facts[f"{shards}_largest_loss_difference_to_flat"] = max(
                abs(a - b) for a, b in zip(by_name[shards]["losses_rank0"], by_name["flat"]["losses_rank0"]))
    for size in sorted({row["numel"] for row in collectives}):
        ops = {row["op"]: row["per_tensor"] for row in collectives if row["numel"] == size}
        if "reduce_scatter_tensor" in ops and "all_gather_into_tensor" in ops:
            facts[f"reduce_scatter_over_all_gather@{size}"] = (ops["reduce_scatter_tensor"]
                                                               / ops["all_gather_into_tensor"])
        if "reduce_scatter_tensor" in ops and "all_reduce" in ops:
            facts[f"reduce_scatter_over_all_reduce@{size}"] = ops["reduce_scatter_tensor"] / ops["all_reduce"]
    return facts


# -- the edge: the cluster ----------------------------------------------------------------------


def launch(configs, sizes, warmup, short, long, timeout=600):
    """Run the rank script across 2 emulated hosts x 2 ranks; answer its marks with the counters."""
    import emulated_cluster as ec

    specs = [ec.HostSpec(ranks=ranks, rate_mbit=RATE_MBIT) for ranks in RANKS]
    with tempfile.TemporaryDirectory(prefix="bench_zero3_link_bytes_") as folder, \
            ec.EmulatedCluster(specs) as cluster:
        out = Path(folder)
        args = ["--out", out, "--configs", ",".join(configs), "--sizes", ",".join(map(str, sizes)),
                "--micro-batch", MICRO_BATCH, "--warmup", warmup, "--short", short, "--long", long]

        def counters(host):
            link = cluster.link_counters(host)
            return link.sent, link.received

        marks, run = launch_answering_marks(cluster, RANK_SCRIPT, args, out, counters, timeout)
        if run is None or not run.ok:
            raise RuntimeError(f"the run failed:\n{run.describe() if run else 'no result'}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(sum(RANKS))]
    return marks, ranks, cluster.leftovers()


def run(quick=False):
    plan = dict(FULL, **(QUICK if quick else {}))
    plan["configs"] = [name for name in CONFIGS if name in plan["configs"]]
    load_start = [round(x, 2) for x in os.getloadavg()]
    began = time.monotonic()
    parameter_bytes = gradient_bytes()
    marks, ranks, leftovers = launch(plan["configs"], plan["sizes"], plan["warmup"], plan["short"], plan["long"])
    zero3 = summarise_zero3(marks, ranks, plan["configs"], plan["short"], plan["long"], parameter_bytes)
    collectives = summarise_collectives(marks, ranks[0]["collectives"], sum(RANKS))
    from deepspeed.runtime.heterogeneous.memory.zero3_settings import PERSISTENCE_KEY, UPSTREAM_DEFAULTS
    report = {"quick": quick, "cluster": {"ranks_per_host": list(RANKS), "rate_mbit": RATE_MBIT,
                                          "slow_host": SLOW_HOST},
              "model": "tiny GPT bench size (seq 128, d_model 128, 4 layers), fp32, AdamW, ZeRO-3",
              "parameter_bytes": parameter_bytes, "micro_batch_per_rank": MICRO_BATCH,
              "steps": {key: plan[key] for key in ("warmup", "short", "long")},
              "torch": ranks[0]["torch"], "backend": ranks[0]["backend"],
              "upstream_persistence_threshold": UPSTREAM_DEFAULTS[PERSISTENCE_KEY],
              "zero3": zero3, "collectives": collectives, "derived": derived(zero3, collectives),
              "namespaces_left": leftovers, "elapsed_s": time.monotonic() - began,
              "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}}
    print_tables(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"JSON written to {RESULTS.relative_to(REPO)}")
    return report


def describe_regathers(found):
    if not found:
        return "none"
    return "; ".join(f"{r['calls']:.0f} calls, {r['bytes'] / 1e6:.2f} MB on groups of {r['group']}"
                     f"{' (across hosts)' if r['group'] > RANKS[0] else ' (inside a host)'}" for r in found)


def print_tables(report):
    mb, n = 1e6, report["parameter_bytes"]
    print(f"\n(a) ZeRO-3 on {len(RANKS)} hosts x {RANKS[0]} ranks at {RATE_MBIT} Mbit/s: slow-link bytes per step "
          f"(both directions), tiny GPT ({n / mb:.2f} MB fp32 parameters = N), micro-batch {MICRO_BATCH}, "
          f"segments of {report['steps']['short']} and {report['steps']['long']} steps"
          f"{' (--quick)' if report['quick'] else ''}, "
          f"{report['elapsed_s']:.0f} s in all")
    print(f"{'config':<50} {'MB/step':>8} {'/flat':>6} {'x N':>5} {'ms/step':>8}  {'hier':>4}  "
          "backward re-gathers per step (rank 0)")
    for row in report["zero3"]:
        print(f"{row['label']:<50} {row['slow_link_bytes'] / mb:>8.2f} {row['vs_flat']:>6.3f} "
              f"{row['per_parameter_bytes']:>5.2f} {1e3 * row['step_time_s']:>8.0f}  "
              f"{'yes' if row['hierarchical'] else 'no':>4}  {describe_regathers(row['backward_regathers'])}"
              f"{'' if row['same_regathers_on_every_rank'] else '  (other ranks re-gathered differently)'}"
              f"{'' if row['hpz_in_force'] else '  (hpZ group NOT as configured)'}"
              f"{'' if row['host_shards'] == (row['mode'] in ('shards', 'coded')) else '  (host shards NOT as configured)'}")
    thresholds = sorted({row["settings"]["param_persistence_threshold"] for row in report["zero3"]})
    persistent = sorted({row["persistent_parameters"] for row in report["zero3"]})
    print(f"stage3_param_persistence_threshold in force (fork enabled): {thresholds} (upstream's default "
          f"{report['upstream_persistence_threshold']}); persistent parameters: {persistent}")
    facts = report["derived"]
    if "regathers_add_bytes" in facts:
        print(f"backward re-gathers on the world group add {facts['regathers_add_bytes'] / mb:.2f} MB/step (flat "
              "+ reuse 0 + prefetch 0 vs flat)")
    if "hpz_saves_with_regathers" in facts:
        print(f"hpZ=2 saves {facts['hpz_saves_with_regathers'] / mb:.2f} MB/step with re-gathers (vs flat + reuse 0"
              " + prefetch 0)" + (f", {round(facts['hpz_saves_without_regathers'] / mb, 2) + 0.0:.2f} MB/step "
                                  "without (vs flat)"
                                  if "hpz_saves_without_regathers" in facts else ""))
    if "hpz_with_regathers_over_no_regathers" in facts:
        print(f"hpZ=2 + reuse 0 + prefetch 0 over flat + prefetch 0 (module-by-module gathers, no re-gathers): "
              f"{facts['hpz_with_regathers_over_no_regathers']:.4f}")

    for key, value in facts.items():
        if key.startswith(("shards", "coded")):
            print(f"{key.replace('_', ' ')}: {value if isinstance(value, bool) else format(value, '.4g')}")
    print(f"\n(b) gloo ({report['torch']}), world of {sum(RANKS)}, one call: slow-link bytes / tensor bytes "
          "(ring: what a ring moves)")
    print(f"{'op':<24} {'tensor MB':>9} {'out':>6} {'in':>6} {'total':>6} {'ring':>6}")
    for row in report["collectives"]:
        size = row["tensor_bytes"]
        print(f"{row['op']:<24} {size / mb:>9.2f} {row['sent'] / size:>6.3f} {row['received'] / size:>6.3f} "
              f"{row['per_tensor']:>6.3f} {row['ring_per_tensor']:>6.3f}")
    for key, value in facts.items():
        if key.startswith("reduce_scatter_over"):
            what, size = key.split("@")
            print(f"{what.replace('_over_', ' / ').replace('_', ' ')} at {int(size) * 4 / mb:.2f} MB: {value:.3f}")
    print(f"Namespaces left: {report['namespaces_left'] or 'none'}; load average start/end "
          f"{report['load_average']['start']} / {report['load_average']['end']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 7 configurations, one size")
    arguments = parser.parse_args()
    os.chdir(REPO)
    run(arguments.quick)
