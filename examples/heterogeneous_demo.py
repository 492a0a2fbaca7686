# SPDX-License-Identifier: Apache-2.0
"""`make demo`: heterogeneous training of a small GPT on an emulated 2-rank cluster.

Rank 0 runs at full speed, rank 1 at 0.4 (a CPU-quota cgroup where the machine allows it, else
time dilation). The demo prints the environment report, then trains twice with the real
`deepspeed` launcher, first with the uniform split (upstream's behaviour), then compute-aware,
with a progress line every few steps, and compares throughput with the ideal speedup of the
speeds asked and of the speeds measured, and the two loss curves: the global batch, its order and
the model are the same, so the curves must agree; only who computes what changes. The configs it
ran stay in ``hetero_demo/`` under the working directory.
"""

import glob
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# In a source tree, the CPU accelerator takes op builders from the top-level op_builder/ when it
# is importable and from deepspeed/ops/op_builder/ otherwise; they compile different copies of
# csrc/, and ninja rebuilds an op (minutes on two cores) whenever the two alternate. Every
# process of the demo therefore sees the tree's root, as the tests do.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
STEPS = 40
BATCH = 16
SPEEDS = [1.0, 0.4]
PROFILE_STEPS = 3
PROGRESS_EVERY = 5  # steps per progress line
MEASURE_FROM = 5  # train_heterogeneous.py leaves the steps before this one out of samples/s
OUTPUT = Path("hetero_demo")  # under the working directory; the configs the demo ran stay there
# How far a measured speed may sit from the asked one before the demo says the emulation missed
# it: the fork's own tolerance (emulation/emulator.py SPEED_TOLERANCE; tests/unit/heterogeneous/test_demo.py
# checks that they agree). Not imported: the demo's own process stays free of deepspeed's start-up.
SPEED_TOLERANCE = 0.15


def demo_config(strategy):
    # No emulation.memory_gb: a memory limit caps the first step before any activation is measured
    # (startup.cap_startup_plan), which would start the compute-aware run from a memory split,
    # not the even one, and has nothing to do with the speeds the demo is about.
    return {
        "train_batch_size": BATCH,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "heterogeneous_config": {
            "enabled": True,
            "load_balancing_strategy": strategy,
            "profile_steps": PROFILE_STEPS,
            "emulation": {"speeds": SPEEDS, "mode": "auto"},
        },
    }


# -- what the demo says (pure: tests/unit/heterogeneous/test_demo.py) ---------------------------


def _speeds(values):
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def ideal_speedup(speeds):
    """The step-time ratio of the even split to the split in proportion to ``speeds`` (per rank,
    samples per second), for the same global batch B over n ranks: (max_r (B/n)/s_r) / (B/sum s)
    = sum(s) / (n min s). Compute only: no fixed cost, whole samples not required."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"ideal_speedup: speeds must be positive, got {speeds}")
    return sum(speeds) / (len(speeds) * min(speeds))


def split_speedup(speeds, sizes):
    """The step-time ratio of the even split to the split ``sizes`` (samples per rank) at
    ``speeds``: what that split can give at best, compute only."""
    if not speeds or min(speeds) <= 0 or len(speeds) != len(sizes):
        raise ValueError(f"split_speedup: one positive speed per rank, got {speeds} for {sizes}")
    even = sum(sizes) / len(sizes)
    return max(even / s for s in speeds) / max(m / s for m, s in zip(sizes, speeds))


def speeds_missed(asked, measured, tolerance=SPEED_TOLERANCE):
    """Whether any rank's measured speed (relative to rank 0's) sits beyond ``tolerance``
    (relative) from the asked one (relative to rank 0's asked speed)."""
    asked = [s / asked[0] for s in asked]
    return any(abs(m - s) > tolerance * s for s, m in zip(asked, measured))


def startup_line(strategy, start, asked, profile_steps):
    """One line on where the start-up plan comes from. ``start``: train_heterogeneous.py's
    ``{"plan", "planned", "scores", "sources"}``: the start-up micro-batches, the plan before any
    memory cap, and the devices' prior scores with their source."""
    plan, planned = start["plan"], start.get("planned") or start["plan"]
    head = f"start-up plan {plan}:"
    if strategy == "uniform":
        return f"{head} the even split, upstream's behaviour; the uniform strategy keeps it for the whole run"
    later = f"the {profile_steps} profiling steps then time each rank and choose the split"
    if plan != planned:
        return (f"{head} the planned {planned} capped by each rank's memory until the first step has measured "
                f"its activations; {later}")
    scores, sources = start.get("scores") or [], start.get("sources") or []
    known = bool(scores) and all(score > 0 for score in scores)
    if len(set(plan)) == 1:
        why = ("the devices' prior scores are equal" if known else
               "the devices have no prior score (no datasheet entry)")
        return (f"{head} even, as nothing is measured yet: {why}, and the planner never reads the emulated "
                f"speeds {asked} (they stand in for devices it would have to measure); {later}")
    source = "/".join(sorted(set(sources))) or "prior"
    return (f"{head} in proportion to the devices' {source} scores {_speeds(scores)} before any measurement; "
            f"{later}")


def progress_line(records, previous, batch, steps, measure_from=MEASURE_FROM):
    """One line for the steps since ``previous`` (the record of the last line, or None) up to the
    last of ``records`` (train_heterogeneous.py's step records: step, loss, plan, elapsed)."""
    last = records[-1]
    done = last["step"] + 1
    first = previous["step"] + 1 if previous else 0
    seconds = last["elapsed"] - (previous["elapsed"] if previous else 0.0)
    rate = batch * (done - first) / seconds if seconds > 0 else float("inf")
    left_out = " (start-up and profiling, left out of the run's samples/s)" if first < measure_from else ""
    return (f"step {done:3d}/{steps}  loss {last['loss']:.4f}  {rate:6.1f} samples/s  plan {last['plan']}"
            f"{left_out}")


def summary_lines(asked, uniform_rate, aware_rate, plan, measured):
    """The speedup beside the ideal for the asked speeds and, where profiling measured them, for
    the measured ones, and what a miss of the asked speeds did to it. ``measured``: per-rank
    speeds relative to rank 0 (train_heterogeneous.py's ``measured_speeds``), or None."""
    speedup = aware_rate / uniform_rate
    ideal_asked = ideal_speedup(asked)
    lines = [f"samples/s: uniform {uniform_rate:.1f}, compute-aware {aware_rate:.1f}: speedup {speedup:.2f}x"]
    if not measured:
        lines.append(f"ideal speedup (even split -> split in proportion to speed): {ideal_asked:.2f}x for the "
                     f"asked speeds {asked}; the profiling steps measured no speeds")
        return lines
    ideal_measured = ideal_speedup(measured)
    lines.append(f"ideal speedup (even split -> split in proportion to speed): {ideal_asked:.2f}x for the asked "
                 f"speeds {asked}, {ideal_measured:.2f}x for the speeds the profiling steps measured "
                 f"{_speeds(measured)}")
    if speeds_missed(asked, measured):
        slower = ideal_measured > ideal_asked
        lines.append(f"the emulation missed the asked speeds (beyond {SPEED_TOLERANCE:.0%}): measured "
                     f"{_speeds(measured)} where {asked} was asked, as when other work holds the cores; the "
                     f"ranks differ {'more' if slower else 'less'} than asked, so the ideal is {ideal_measured:.2f}x, "
                     f"not {ideal_asked:.2f}x, and the speedup is to be read against {ideal_measured:.2f}x")
    else:
        lines.append(f"the emulation held the asked speeds (within {SPEED_TOLERANCE:.0%})")
    best = split_speedup(measured, plan)
    if speedup > ideal_measured * (1 + SPEED_TOLERANCE):
        lines.append(f"the speedup is above the ideal of the measured speeds: the two runs saw different loads "
                     f"(only the compute-aware run's speeds were measured, in its first {PROFILE_STEPS} steps)")
    elif speedup > best:
        lines.append(f"the plan it ran, {plan}, gives {best:.2f}x at the measured speeds (whole samples per rank); "
                     f"the {speedup:.2f}x measured is above that, within the timing noise of two runs: the uniform "
                     f"run was slower, or the compute-aware run faster, than those speeds say (only the "
                     f"compute-aware run's speeds were measured, in its first {PROFILE_STEPS} steps)")
    else:
        rest = ("; the rest of the gap is work a split does not shorten (the optimizer step, the gradient "
                "reduction)" if speedup < best else "")
        lines.append(f"the plan it ran, {plan}, gives at most {best:.2f}x at the measured speeds (whole samples per "
                     f"rank){rest}")
    return lines


# -- running it ---------------------------------------------------------------------------------


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def banner(text):
    print(f"\n=== {text} " + "=" * max(0, 76 - len(text)), flush=True)


def shown(line):
    """The launcher's lines the demo passes on: the fork's plan blocks (titles, what changed, the
    tables, their notes and the emulation line) and op builds, which take minutes the first time."""
    text = line.strip()
    return (line.startswith("[deepspeed-hetero]") or text.startswith(("rank ", "strategy ", "note:", "emulated:",
                                                                       "micro-batches ", "warning:"))
            or text.split(" ", 1)[0] in ("0", "1") or text.startswith("DeepSpeed: building op"))


def train(strategy, config_path):
    """Launch 2 ranks, passing the plan blocks on and printing progress as the lines come; returns
    (per-step records, summary)."""
    port = free_port()
    records, summary, output, previous = [], None, [], None
    try:
        proc = subprocess.Popen([
            str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
            str(HERE / "train_heterogeneous.py"), "--deepspeed_config", str(config_path), "--steps", str(STEPS)
        ], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        for line in proc.stdout:
            line = line.rstrip("\n")
            output.append(line)
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("summary"):
                    summary = record
                elif "start" in record:
                    print(startup_line(strategy, record["start"], SPEEDS, PROFILE_STEPS), flush=True)
                else:
                    records.append(record)
                    if (record["step"] + 1) % PROGRESS_EVERY == 0 or record["step"] + 1 == STEPS:
                        print(progress_line(records, previous, BATCH, STEPS), flush=True)
                        previous = record
            elif shown(line):
                print(line, flush=True)
        returncode = proc.wait(timeout=1800)
    finally:
        # The fork unlinks the CPU all-reduce's 66 MiB /dev/shm buffers once every rank has mapped
        # them (patches/cpu-shm-unlink-buffers.patch); a rank killed before that leaves its own.
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.unlink(path)
    if returncode != 0 or summary is None:
        print(f"training failed (exit {returncode}); its output follows:\n" + "\n".join(output))
        raise SystemExit(returncode or 1)
    return records, summary


def main():
    OUTPUT.mkdir(exist_ok=True)
    configs = {}
    for strategy in ("uniform", "compute_aware"):
        configs[strategy] = OUTPUT / f"{strategy}.json"
        configs[strategy].write_text(json.dumps(demo_config(strategy), indent=2) + "\n")

    banner(f"deepspeed env_report --heterogeneous --config {configs['compute_aware']}")
    report = subprocess.run([str(BIN / "deepspeed"), "env_report", "--heterogeneous", "--config",
                             str(configs["compute_aware"])], env=ENV)
    if report.returncode != 0:
        return report.returncode

    results = {}
    for strategy in ("uniform", "compute_aware"):
        banner(f"training, {strategy} split (2 ranks, speeds {SPEEDS}, {STEPS} steps, {configs[strategy]})")
        start = time.time()
        records, summary = train(strategy, configs[strategy])
        results[strategy] = (records, summary)
        print(f"{summary['samples_per_s']:.1f} samples/s from step {MEASURE_FROM + 1} on, emulation by "
              f"{summary['emulation']}, {time.time() - start:.0f} s in all", flush=True)

    banner("summary")
    uniform, aware = results["uniform"], results["compute_aware"]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(uniform[0], aware[0]))
    plan = aware[0][-1]["plan"]
    print(f"plan: uniform {uniform[0][-1]['plan']} -> compute-aware {plan}")
    for line in summary_lines(SPEEDS, uniform[1]["samples_per_s"], aware[1]["samples_per_s"], plan,
                              aware[1].get("measured_speeds")):
        print(line)
    print(f"loss curves: first {uniform[0][0]['loss']:.4f}, last {uniform[0][-1]['loss']:.4f} (uniform) vs "
          f"{aware[0][-1]['loss']:.4f} (compute-aware); largest difference over {STEPS} steps: {gap:.2e}")
    print(f"the configs it ran: {configs['uniform']}, {configs['compute_aware']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
