# SPDX-License-Identifier: Apache-2.0
"""``communication.mode: "low_communication"`` against exact training at 20 Mbit/s between 2 hosts.

The cluster and model are bench_communication.py's (``scripts/emulated_cluster.py``: 2 hosts x 2
ranks, ``tbf``-shaped links; the tiny GPT at bench size, fp32, AdamW lr 3e-4, ZeRO-2, one torch
thread per rank, micro-batch ``MICRO_BATCH`` per rank, the same samples in the same order in every
mode). Three launches:

1. ``lowcomm`` at 20 Mbit/s for 300 steps (``sync_every`` 50, pseudo-gradients in bf16), once per
   outer setting (``OUTER_SETTINGS``: the defaults, Nesterov lr 1 with momentum 0.5; DiLoCo's, lr 0.7
   with momentum 0.9; plain averaging of the replicas, lr 1 without momentum): its step time, slow-link bytes per step
   and communication share (the comm clock: the main thread's time in collectives over the step
   time), measured over whole synchronisation periods (the marks are 50 and 100 steps apart); its
   inter-host share (the synchronisations' time over the step time: apart from the fork's small
   per-forward agreement, the only traffic on the link); its training losses and, after a final
   synchronisation, the loss on 64 held-out samples;
2. the fork's exact mode (hierarchical reduction with overlap, the default on several hosts) at
   20 Mbit/s for a few steps: its step time, bytes and share there;
3. the same exact mode at 200 Mbit/s for the same 300 steps: its loss curve. Exact training's
   parameters do not depend on the link (the tests prove it equal to one process on the global
   batch), so this is exact training's loss at 20 Mbit/s too, and its time axis is launch 2's step
   time.

Reported: the loss gap at equal samples (held-out loss of the final models; the mean training loss
of the last 50 steps), the loss gap at equal wall time (exact training's training loss at the
step it reaches at 20 Mbit/s in the time low-communication training took for all its steps), bytes
per step and share for both. Targets: share < 10% and a held-out loss within 2% of exact training's
at equal samples.

    python tests/perf/bench_low_communication.py           # ~8 min, root; JSON in tests/perf/results/
    python tests/perf/bench_low_communication.py --quick   # fewer steps (sync_every 10): the plumbing only
    python tests/perf/bench_low_communication.py --outer 0.7,0.5 --outer 1,0.5 --sync-every 25   # other settings
"""

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "scripts"), str(REPO / "tests" / "perf")]

import bench_communication as bc  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "low_communication.json"
SLOW_MBIT = 20
FAST_MBIT = 200
MICRO_BATCH = 8
STAGE = 2
EVAL_SAMPLES = 64
FULL = dict(sync_every=50, steps=300, exact_steps=(1, 1, 3), window=50)
QUICK = dict(sync_every=10, steps=40, exact_steps=(1, 1, 2), window=10)
"""The warm-up is what ``steps`` leaves before the marks, which lie sync_every and 2 x sync_every apart."""
TARGETS = {"share": 0.10, "loss_gap": 0.02}
OUTER_SETTINGS = (("Nesterov lr 1 momentum 0.5 (the defaults)", {"lr": 1.0, "momentum": 0.5}),
                  ("Nesterov lr 0.7 momentum 0.9 (DiLoCo's)", {"lr": 0.7, "momentum": 0.9}),
                  ("averaging (lr 1, no momentum)", {"lr": 1.0, "momentum": 0.0}))


def segment(scenario_name, rate, modes, warmup, short, long, sync_every=None, outer=None, progress=None):
    scenario = bc.Scenario(scenario_name, (2, 2), (rate, rate), (STAGE, ))
    extra = ["--modes", modes, "--eval-samples", EVAL_SAMPLES]
    if sync_every:
        extra += ["--sync-every", sync_every, "--pseudo-dtype", "bf16", "--outer-lr", outer["lr"],
                  "--outer-momentum", outer["momentum"]]
    marks, results, launch = bc.run_scenario(scenario, (STAGE, ), 1, warmup, short, long, micro_batch=MICRO_BATCH,
                                             extra=extra, timeout=1800, progress=progress)
    tag = f"zero{STAGE}-{modes}-r0"
    runs = [result["runs"][tag] for result in results]
    step = runs[0]["seconds"] / runs[0]["long_steps"]
    comm = sum(run["comm_seconds"] / run["long_steps"] for run in runs) / len(runs)
    link = bc.step_bytes([marks[f"{tag}-{x}"][1] for x in "abc"], short, long)
    syncs = [run["sync_seconds"] for run in runs if run.get("sync_seconds") is not None]
    sync = sum(syncs) / len(syncs) / runs[0]["long_steps"] if syncs else None
    # The mean over the ranks of each step's training loss (equal micro-batches: the global batch's).
    losses = [sum(run["losses"][i] for run in runs) / len(runs) for i in range(len(runs[0]["losses"]))]
    return {"rate_mbit": rate, "steps": warmup + short + long, "step_time_s": step, "comm_time_s": comm,
            "comm_share": comm / step, "sync_time_s": sync, "inter_host_share": None if sync is None else sync / step,
            "slow_link_bytes_per_step": link, "eval_loss": runs[0]["eval_loss"],
            "losses": losses, "launch": launch}


def mean(values):
    return sum(values) / len(values)


def parse_outer(text):
    """``--outer LR,MOMENTUM`` -> a named outer setting."""
    lr, momentum = (float(x) for x in text.split(","))
    return (f"outer lr {lr:g} momentum {momentum:g}", {"lr": lr, "momentum": momentum})


def run(quick=False, outer_settings=OUTER_SETTINGS, sync_every=None):
    plan = dict(FULL, **(QUICK if quick else {}))
    if sync_every:
        plan["sync_every"] = sync_every
    load_start = [round(x, 2) for x in os.getloadavg()]
    began = time.monotonic()
    h = plan["sync_every"]
    runs = 2 + len(outer_settings)  # one run per launch: two exact, one per outer setting
    progress = bc.Progress(runs, total_launches=runs)
    exact_slow = segment("exact, slow link", SLOW_MBIT, "hier", *plan["exact_steps"], progress=progress)
    warmup = plan["steps"] - 3 * h
    if warmup < 1:
        raise ValueError(f"sync_every {h} leaves no warm-up in {plan['steps']} steps")
    exact_curve = segment("exact, loss curve", FAST_MBIT, "hier", warmup, h, 2 * h, progress=progress)
    steps, window = exact_curve["steps"], plan["window"]
    exact_train = mean(exact_curve["losses"][-window:])
    report = {
        "quick": quick, "model": "tiny GPT bench size, fp32, AdamW lr 3e-4, ZeRO-2", "hosts": "2 x 2 ranks",
        "micro_batch_per_rank": MICRO_BATCH, "sync_every": h, "pseudo_gradient_dtype": "bf16",
        "steps": steps, "window": window, "targets": TARGETS,
        "exact_at_20mbit": {k: v for k, v in exact_slow.items() if k != "losses"},
        "exact_loss_curve": {k: v for k, v in exact_curve.items() if k != "losses"},
        "losses": {"exact": exact_curve["losses"]}, "low_communication": []}
    for name, outer in outer_settings:
        low = segment(f"low-communication, {name}", SLOW_MBIT, "lowcomm", warmup, h, 2 * h, sync_every=h,
                      outer=outer, progress=progress)
        low_train = mean(low["losses"][-window:])
        # Equal wall time: the step exact training reaches at 20 Mbit/s in the time low-communication
        # training takes for all its steps.
        reached = min(steps, max(1, int(steps * low["step_time_s"] / exact_slow["step_time_s"])))
        exact_at_wall = mean(exact_curve["losses"][max(0, reached - window):reached])
        report["losses"][name] = low["losses"]
        report["low_communication"].append({
            "outer": name, "outer_lr": outer["lr"], "outer_momentum": outer["momentum"],
            **{k: v for k, v in low.items() if k != "losses"},
            "equal_samples": {"eval_loss_low": low["eval_loss"], "eval_loss_exact": exact_curve["eval_loss"],
                              "eval_gap": low["eval_loss"] / exact_curve["eval_loss"] - 1,
                              "train_loss_low": low_train, "train_loss_exact": exact_train,
                              "train_gap": low_train / exact_train - 1},
            "equal_wall_time": {"seconds": steps * low["step_time_s"], "exact_step_reached": reached,
                                "train_loss_low": low_train, "train_loss_exact": exact_at_wall,
                                "gap": low_train / exact_at_wall - 1},
            "bytes_per_step_vs_exact": low["slow_link_bytes_per_step"] / exact_slow["slow_link_bytes_per_step"],
            "step_time_vs_exact": low["step_time_s"] / exact_slow["step_time_s"]})
    return bc.finish_report(report, began, load_start, print_table, RESULTS)


def print_table(report):
    exact = report["exact_at_20mbit"]
    print(f"\nlow-communication vs exact: {report['hosts']} at {SLOW_MBIT} Mbit/s, {report['model']}, micro-batch "
          f"{report['micro_batch_per_rank']}, {report['steps']} steps, sync_every {report['sync_every']} (bf16), "
          f"{report['elapsed_s']:.0f} s")
    print(f"{'mode':<42} {'step ms':>8} {'comm ms':>8} {'share':>6} {'inter-host':>11} {'slow-link MB/step':>18}")
    rows = [(f"low-communication, {low['outer']}", low) for low in report["low_communication"]]
    for name, row in rows + [("exact (hierarchical, overlap)", exact)]:
        inter = "-" if row["inter_host_share"] is None else f"{row['inter_host_share']:.1%}"
        print(f"{name:<42} {1e3 * row['step_time_s']:>8.0f} {1e3 * row['comm_time_s']:>8.0f} "
              f"{row['comm_share']:>6.1%} {inter:>11} {row['slow_link_bytes_per_step'] / 1e6:>18.3f}")
    print("  share: every collective (in-host ZeRO-2 reductions and waits for the other ranks included) over the "
          "step; inter-host: the synchronisations")
    for low in report["low_communication"]:
        same, wall = low["equal_samples"], low["equal_wall_time"]
        print(f"{low['outer']}: equal samples ({report['steps']} steps): held-out loss {same['eval_loss_low']:.4f} vs "
              f"exact {same['eval_loss_exact']:.4f} ({same['eval_gap']:+.2%}), training loss (last {report['window']} "
              f"steps) {same['train_loss_low']:.4f} vs {same['train_loss_exact']:.4f} ({same['train_gap']:+.2%}); "
              f"equal wall time ({wall['seconds']:.0f} s, exact at step {wall['exact_step_reached']}): "
              f"{wall['train_loss_low']:.4f} vs {wall['train_loss_exact']:.4f} ({wall['gap']:+.2%}); step "
              f"x{low['step_time_vs_exact']:.3f} and bytes x{low['bytes_per_step_vs_exact']:.3f} of exact; "
              f"inter-host share < {TARGETS['share']:.0%} "
              f"{'met' if low['inter_host_share'] < TARGETS['share'] else 'NOT met'}, held-out loss within "
              f"{TARGETS['loss_gap']:.0%} {'met' if abs(same['eval_gap']) < TARGETS['loss_gap'] else 'NOT met'}")
    print(f"load average start/end {report['load_average']['start']} / {report['load_average']['end']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sync_every 10 and fewer steps")
    parser.add_argument("--outer", action="append", type=parse_outer, metavar="LR,MOMENTUM",
                        help="an outer setting to run instead of OUTER_SETTINGS (repeatable)")
    parser.add_argument("--sync-every", type=int, default=None, help="instead of 50 (the marks follow it)")
    arguments = parser.parse_args()
    os.chdir(REPO)
    run(arguments.quick, tuple(arguments.outer or OUTER_SETTINGS), arguments.sync_every)
