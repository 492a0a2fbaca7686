# SPDX-License-Identifier: Apache-2.0
"""The fork's autotuner (``deepspeed --autotuning tune``) against an exhaustive grid.

Workload: the project's small GPT (examples/tiny_gpt, ``GPTConfig.bench()``: seq 128, d 128,
4 layers), fp32, one torch thread per rank, 2 ranks, AdamW, global batch (train_batch_size)
fixed at 32 so every allocation is comparable. Training script: tests/perf/autotune_train.py.
Every experiment, grid and tuner alike, is one ``deepspeed`` launch through the tuner's own
ExperimentRunner with the tuner's experiment ds_config (``space.Experiment(...).ds_config``) and
the same window: autotuning start_profile_step 3, end_profile_step 8 (5 timed optimizer steps;
the tuner's profiling run shifts it past its 3 profiling steps). The metric is throughput
(samples/s) of the slowest rank over the window.

Two clusters:

emulated     heterogeneous_config.emulation speeds [1.0, 0.4], mode "auto" (a CPU-quota cgroup
             where the machine allows it, else time dilation). Grid: ZeRO 0-3 x per-rank
             micro-batches [16, 16] (uniform), [20, 12], [24, 8], [28, 4] x gas 1 = 16 experiments.
homogeneous  no heterogeneous_config (upstream's uniform data parallelism). Grid: ZeRO 0-3 x
             (per-GPU micro-batch 16, gas 1), (8, gas 2) = 8 experiments (global batch 32).

(gas 2 on the emulated cluster would double its grid, past this 2-core machine's ~35 minute
budget for the whole benchmark.)

The tuner runs as ``python -m deepspeed.launcher.runner --autotuning tune --num_gpus 2
tests/perf/autotune_train.py --deepspeed_config cfg.json`` over the same space (the same ZeRO
stages, gas values and global batch; on the emulated cluster with heterogeneous_config and the
emulation enabled, so it tunes per-rank allocations), in two modes:

fast         "fast": true (the default)
model_based  "fast": false, "tuner_type": "model_based" (default early stopping and trials)

Reported per cluster: the grid's experiments and wall time, its best point and its best uniform
point; per tuner mode: experiments run (results.json entries not "predicted out of memory", the
profiling run included), tuning wall time, the chosen configuration (ds_config_optimal.json),
its measured throughput as a fraction of the grid's best. Targets (printed, not asserted):
within 5% of the grid's best using at most a third of the grid's experiments; on the emulated
cluster, the tuned configuration's speedup over the best uniform grid point, next to the
load-balancing benchmark's compute-aware speedup over uniform (tests/perf/results/
load_balancing.json; 1.66-1.85x on its last run).

Timing is wall clock on a shared 2-core machine: anything else running adds noise, and each
configuration is measured once (the tuner's own measurement of its choice is compared with the
grid's best, so the fraction can exceed 1). Every grid point and tuner run records the "other
load": the CPU cores, on average, that processes other than this benchmark's kept busy meanwhile
(/proc/stat minus this process tree); above ~0.2 of the 2 cores, treat the number as disturbed.

    python tests/perf/bench_autotuning.py                      (from the repository root)
    python tests/perf/bench_autotuning.py --clusters emulated --modes fast --keep
    python tests/perf/bench_autotuning.py --pruning            (fast mode with and without plan pruning)

``--pruning`` runs no grid: fast mode as it is (``autotuning.plan_pruning`` true, the default: ZeRO-3
is not run where ZeRO-2 is predicted to fit its best candidate) beside fast mode without pruning
(``plan_pruning: false``) on the emulated cluster, alternately, ``--repeats`` times each, and reports
per run the experiments run, the stages pruned and the configuration chosen.
Writes tests/perf/results/autotuning_pruning.json.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

SCRIPT = "tests/perf/autotune_train.py"  # relative to REPO, where everything runs
RESULTS = REPO / "tests" / "perf" / "results" / "autotuning.json"
LOAD_BALANCING = REPO / "tests" / "perf" / "results" / "load_balancing.json"
NUM_GPUS = 2
GLOBAL_BATCH = 32
SPEEDS = [1.0, 0.4]
STAGES = [0, 1, 2, 3]
WINDOW = {"start_profile_step": 3, "end_profile_step": 8}
EXPERIMENT_TIMEOUT = 600
TUNE_TIMEOUT = 40 * 60
WITHIN = 0.05
EXPERIMENT_FRACTION = 1 / 3
LAST_LOAD_BALANCING = (1.66, 1.85)

CLUSTERS = {
    "emulated": {
        "description": f"2 ranks, emulation speeds {SPEEDS}, mode auto",
        "gas": [1],
        "allocations": {1: [(16, 16), (20, 12), (24, 8), (28, 4)]},
        "heterogeneous": True,
    },
    "homogeneous": {
        "description": "2 ranks, no heterogeneous_config",
        "gas": [1, 2],
        "allocations": {1: [(16, 16)], 2: [(8, 8)]},
        "heterogeneous": False,
    },
}
MODES = {
    "fast": {"fast": True},
    "model_based": {"fast": False, "tuner_type": "model_based"},
    # Fast mode without plan pruning: every ZeRO stage's best candidate runs.
    "fast_unpruned": {"fast": True, "plan_pruning": False},
}
DEFAULT_MODES = ["fast", "model_based"]
PRUNING_RESULTS = REPO / "tests" / "perf" / "results" / "autotuning_pruning.json"


class CpuMeter:
    """CPU time spent by others on this machine: /proc/stat's busy time minus this process's and
    its reaped children's (the experiments' launchers and ranks). In cores, averaged over the span:
    another job (e.g. a test run) competing with the two ranks for the two cores."""

    def __init__(self):
        self.began = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as handle:
                fields = [int(v) for v in handle.readline().split()[1:]]
            # user nice system idle iowait irq softirq steal: busy leaves out idle and iowait
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            busy = None
        times = os.times()
        return busy, times.user + times.system + times.children_user + times.children_system, time.monotonic()

    def other_cores(self):
        busy, mine, now = self._sample()
        if busy is None or self.began[0] is None or now <= self.began[2]:
            return None
        return max(0.0, ((busy - self.began[0]) - (mine - self.began[1])) / (now - self.began[2]))


def _environment():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def user_config(cluster, work, mode=None):
    """The ds_config a user would hand the tuner for this cluster (and mode)."""
    spec = CLUSTERS[cluster]
    autotuning = {
        "enabled": True,
        "metric": "throughput",
        **WINDOW,
        "experiment_timeout": EXPERIMENT_TIMEOUT,
        "results_dir": os.path.join(work, "autotuning_results"),
        "exps_dir": os.path.join(work, "autotuning_exps"),
        "gradient_accumulation_steps": list(spec["gas"]),
        # Stages 0-3 as "auto" (the same four): the tuner as first committed (2c1d7ef) rejected a
        # stage list holding 0; 12272e9 fixed that.
        "zero_optimization": {"stage": "auto"},
        **MODES.get(mode, {}),
    }
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
        "autotuning": autotuning,
    }
    if spec["heterogeneous"]:
        config["heterogeneous_config"] = {"enabled": True, "emulation": {"speeds": list(SPEEDS), "mode": "auto"}}
    return config


def grid_experiments(cluster):
    from deepspeed.autotuning.heterogeneous.experiment import Experiment
    spec = CLUSTERS[cluster]
    return [
        Experiment(stage=stage, gas=gas, micro_batch_sizes=tuple(sizes), heterogeneous=spec["heterogeneous"])
        for stage in STAGES for gas in spec["gas"] for sizes in spec["allocations"][gas]
    ]


def run_grid(cluster, work):
    """Every grid point as the tuner runs an experiment; returns the rows and the wall time."""
    from deepspeed.autotuning.heterogeneous.results import OK, metric_value
    from deepspeed.autotuning.heterogeneous.runner import ExperimentRunner
    from deepspeed.autotuning.heterogeneous.settings import parse_settings

    os.makedirs(work, exist_ok=True)
    config = user_config(cluster, work)
    config_path = os.path.join(work, "ds_config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)
    settings = parse_settings(config)
    runner = ExperimentRunner(["--num_gpus", str(NUM_GPUS)], SCRIPT, ["--deepspeed_config", config_path], {},
                              EXPERIMENT_TIMEOUT, env=_environment())
    experiments = grid_experiments(cluster)
    rows = []
    began = time.monotonic()
    for number, experiment in enumerate(experiments, 1):
        exp_dir = os.path.join(work, "grid", experiment.name)
        ds_config = experiment.ds_config(config, os.path.join(exp_dir, "metrics.json"), settings)
        meter = CpuMeter()
        status, message, metrics, seconds = runner.run(experiment, ds_config, exp_dir)
        other = meter.other_cores()
        value = metric_value(metrics, "throughput") if status == OK else None
        rows.append({"name": experiment.name, "stage": experiment.stage, "gas": experiment.gas,
                     "micro_batch_sizes": list(experiment.micro_batch_sizes), "uniform": experiment.uniform,
                     "status": status, "throughput": value, "seconds": seconds, "other_load_cores": other,
                     "error": message.splitlines()[-1] if message else ""})
        shown = f"{value:.2f} samples/s" if value is not None else f"{status}: {rows[-1]['error']}"
        print(f"[{cluster} grid {number}/{len(experiments)}] {experiment.name}: {shown} ({seconds:.0f} s, other "
              f"load {_cores(other)} cores)", flush=True)
    return rows, time.monotonic() - began


def _chosen(optimal):
    """(stage, gas, per-rank sizes) of a ds_config_optimal.json."""
    stage = (optimal.get("zero_optimization") or {}).get("stage")
    gas = optimal.get("gradient_accumulation_steps", 1)
    hetero = optimal.get("heterogeneous_config") or {}
    if hetero.get("enabled") and hetero.get("micro_batch_sizes"):
        sizes = list(hetero["micro_batch_sizes"])
    elif optimal.get("train_micro_batch_size_per_gpu"):
        sizes = [optimal["train_micro_batch_size_per_gpu"]] * NUM_GPUS
    else:
        per_step = optimal["train_batch_size"] // gas
        sizes = [per_step // NUM_GPUS] * NUM_GPUS
    return stage, gas, sizes


def run_tuner(cluster, mode, work):
    """One ``deepspeed --autotuning tune`` run; its outcome from results.json and the optimal config."""
    from deepspeed.autotuning.heterogeneous.results import NOT_RUN, OK, PRUNED
    os.makedirs(work, exist_ok=True)
    config = user_config(cluster, work, mode)
    config_path = os.path.join(work, "ds_config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2)
    command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--autotuning", "tune", "--num_gpus",
               str(NUM_GPUS), SCRIPT, "--deepspeed_config", config_path]
    log_path = os.path.join(work, "tune.log")
    print(f"[{cluster} {mode}] {' '.join(command)}", flush=True)
    began = time.monotonic()
    meter = CpuMeter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_environment(),
                                   text=True, start_new_session=True)
        try:
            for line in process.stdout:
                log.write(line)
                if line.startswith("[autotuning]"):
                    print(f"[{cluster} {mode}] {line.rstrip()}", flush=True)
            process.wait(timeout=TUNE_TIMEOUT)
        finally:
            if process.poll() is None:
                from deepspeed.autotuning.heterogeneous.runner import kill_group
                kill_group(process)
                process.wait()
    wall = time.monotonic() - began
    results_dir = config["autotuning"]["results_dir"]
    row = {"mode": mode, "returncode": process.returncode, "wall_seconds": wall, "other_load_cores":
           meter.other_cores(), "log": log_path}
    results_path = os.path.join(results_dir, "results.json")
    if not os.path.exists(results_path):
        row["error"] = f"no results.json (exit {process.returncode}); see {log_path}"
        return row
    with open(results_path) as handle:
        results = json.load(handle)
    experiments = results["experiments"]
    ran = [e for e in experiments if e["status"] not in NOT_RUN]
    pruned = [e["name"] for e in experiments if e["status"] == PRUNED]
    row.update(tuning_seconds=results.get("tuning_seconds"), profile=results.get("profile"),
               experiments_run=len(ran), candidates_predicted_oom=len(experiments) - len(ran) - len(pruned),
               pruned=pruned,
               experiments=[{k: e.get(k) for k in ("name", "status", "value", "predicted", "seconds")}
                            for e in experiments])
    ok = [e for e in ran if e["status"] == OK and e["value"] is not None]
    if not ok:
        row["error"] = f"no successful experiment (exit {process.returncode}); see {log_path}"
        return row
    best = max(ok, key=lambda e: e["value"])
    row.update(best_name=best["name"], best_throughput=best["value"])
    optimal_path = os.path.join(results_dir, "ds_config_optimal.json")
    if os.path.exists(optimal_path):
        with open(optimal_path) as handle:
            optimal = json.load(handle)
        stage, gas, sizes = _chosen(optimal)
        row.update(chosen={"stage": stage, "gas": gas, "micro_batch_sizes": sizes})
    return row


def _cores(value):
    return "?" if value is None else f"{value:.2f}"


def _grid_name(chosen):
    from deepspeed.autotuning.heterogeneous.experiment import Experiment
    sizes = tuple(chosen["micro_batch_sizes"])
    return Experiment(stage=chosen["stage"], gas=chosen["gas"], micro_batch_sizes=sizes).name


def summarise(cluster, grid, grid_seconds, tuners, load_balancing):
    ok = [r for r in grid if r["throughput"] is not None]
    best = max(ok, key=lambda r: r["throughput"]) if ok else None
    uniform = [r for r in ok if r["uniform"]]
    best_uniform = max(uniform, key=lambda r: r["throughput"]) if uniform else None
    by_name = {r["name"]: r for r in ok}
    for row in tuners:
        if "best_throughput" not in row or best is None:
            continue
        row["fraction_of_grid_best"] = row["best_throughput"] / best["throughput"]
        row["experiment_fraction_of_grid"] = row["experiments_run"] / len(grid)
        row["within_target"] = row["fraction_of_grid_best"] >= 1.0 - WITHIN
        row["experiments_target"] = row["experiments_run"] <= EXPERIMENT_FRACTION * len(grid)
        row["meets_target"] = row["within_target"] and row["experiments_target"]
        if "chosen" in row:
            same = by_name.get(_grid_name(row["chosen"]))
            row["chosen_grid_point"] = same["name"] if same else None
            row["chosen_grid_throughput"] = same["throughput"] if same else None
        if cluster == "emulated" and best_uniform is not None:
            row["speedup_over_best_uniform"] = row["best_throughput"] / best_uniform["throughput"]
            row["load_balancing_speedup"] = load_balancing
    return {
        "cluster": cluster, "description": CLUSTERS[cluster]["description"],
        "space": {"zero_stages": STAGES, "gas": CLUSTERS[cluster]["gas"], "train_batch_size": GLOBAL_BATCH,
                  "micro_batch_sizes_by_gas": {str(g): [list(s) for s in a]
                                               for g, a in CLUSTERS[cluster]["allocations"].items()}},
        "grid_experiments": len(grid), "grid_ok": len(ok), "grid_wall_seconds": grid_seconds,
        "grid_other_load_cores_mean": _mean([r["other_load_cores"] for r in grid]),
        "grid_best": None if best is None else {"name": best["name"], "throughput": best["throughput"]},
        "grid_best_uniform": None if best_uniform is None else {"name": best_uniform["name"],
                                                                "throughput": best_uniform["throughput"]},
        "grid": grid, "tuners": tuners,
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def load_balancing_speedups():
    """The load-balancing benchmark's compute-aware speedups over uniform, per ZeRO stage."""
    if LOAD_BALANCING.exists():
        try:
            report = json.loads(LOAD_BALANCING.read_text())
            speedups = {str(r["zero_stage"]): r["speedup_over_uniform"] for r in report["stages"]}
            return {"source": str(LOAD_BALANCING.relative_to(REPO)), "by_stage": speedups,
                    "min": min(speedups.values()), "max": max(speedups.values())}
        except (ValueError, KeyError, TypeError):
            pass
    return {"source": "last run (stated)", "by_stage": None, "min": LAST_LOAD_BALANCING[0],
            "max": LAST_LOAD_BALANCING[1]}


def emulation_mode():
    """What mode "auto" gives a slowed rank on this machine (cgroup where possible)."""
    # In a child process: a cgroup emulator moves its own process into the throttled cgroup.
    probe = ("from deepspeed.runtime.heterogeneous.emulation.emulator import Emulator\n"
             f"e = Emulator({SPEEDS[1]}, 'auto', threads=1); print('MODE', e.mode); e.close()")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             env=_environment()).stdout
        return next(line.split()[1] for line in out.splitlines() if line.startswith("MODE "))
    except (subprocess.SubprocessError, StopIteration, IndexError) as exc:  # the ranks decide for themselves
        return f"unknown ({type(exc).__name__})"


def clean_shm(work):
    """/dev/shm all-reduce buffers of every experiment this benchmark launched (by its ports)."""
    ports = set()
    for path in glob.glob(os.path.join(work, "**", "cmd.txt"), recursive=True):
        with open(path) as handle:
            ports.update(re.findall(r"--master_port (\d+)", handle.read()))
    removed = 0
    for port in ports:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def print_table(report):
    lb = report["load_balancing_speedup"]
    print(f"\nautotuning vs exhaustive grid: tiny GPT bench size, {NUM_GPUS} ranks, train_batch_size "
          f"{GLOBAL_BATCH}, window steps {WINDOW['start_profile_step']}-{WINDOW['end_profile_step']}, emulation "
          f"{report['emulation']}")
    for cluster in report["clusters"]:
        print(f"\n== {cluster['cluster']} ({cluster['description']}); space: ZeRO {cluster['space']['zero_stages']}, "
              f"gas {cluster['space']['gas']}, per-rank micro-batches {cluster['space']['micro_batch_sizes_by_gas']}")
        print(f"{'grid point':<22} {'samples/s':>9}  {'other load':>10}")
        for row in cluster["grid"]:
            value = f"{row['throughput']:.2f}" if row["throughput"] is not None else row["status"]
            print(f"{row['name']:<22} {value:>9}  {_cores(row['other_load_cores']):>10}")
        best, uniform = cluster["grid_best"], cluster["grid_best_uniform"]
        print(f"grid: {cluster['grid_experiments']} experiments in {cluster['grid_wall_seconds'] / 60:.1f} min (other "
              f"load {_cores(cluster['grid_other_load_cores_mean'])} cores on average); "
              f"best {best['name'] if best else '-'} {best['throughput'] if best else float('nan'):.2f}; best uniform "
              f"{uniform['name'] if uniform else '-'} {uniform['throughput'] if uniform else float('nan'):.2f}")
        print(f"{'tuner':<12} {'exps':>4} {'wall':>7}  {'chosen':<22} {'samples/s':>9} {'of best':>7}  "
              f"{'<=5%':>6} {'<=1/3 exps':>13}  {'other load':>10}" +
              ("  speedup vs best uniform" if cluster["cluster"] == "emulated" else ""))
        for row in cluster["tuners"]:
            if "fraction_of_grid_best" not in row:
                print(f"{row['mode']:<12} failed: {row.get('error')}")
                continue
            count = f"{'met' if row['experiments_target'] else 'MISSED'} ({row['experiments_run']}/" \
                    f"{cluster['grid_experiments']})"
            line = (f"{row['mode']:<12} {row['experiments_run']:>4} {row['wall_seconds'] / 60:>5.1f}m  "
                    f"{row['best_name']:<22} {row['best_throughput']:>9.2f} {row['fraction_of_grid_best']:>7.1%}  "
                    f"{'met' if row['within_target'] else 'MISSED':>6} {count:>13}  "
                    f"{_cores(row['other_load_cores']):>10}")
            if "speedup_over_best_uniform" in row:
                line += (f"  {row['speedup_over_best_uniform']:.2f}x (load balancing {lb['min']:.2f}-"
                         f"{lb['max']:.2f}x)")
            print(line)
            if row.get("chosen_grid_throughput") is not None:
                print(f"{'':<12} chosen point measured by the grid: {row['chosen_grid_throughput']:.2f} samples/s "
                      f"({row['chosen_grid_throughput'] / best['throughput']:.1%} of the grid's best)")
    print(f"\ntotal wall time {report['total_wall_seconds'] / 60:.1f} min; load average at start/end "
          f"{report['load_average']['start']} / {report['load_average']['end']}")


def run(clusters, modes, keep=False):
    began = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    work = tempfile.mkdtemp(prefix="bench_autotuning_")
    lb = load_balancing_speedups()
    report = {
        "workload": "tiny GPT bench size (seq 128, d_model 128, 4 layers), fp32, 1 thread per rank, AdamW",
        "script": SCRIPT, "num_gpus": NUM_GPUS, "train_batch_size": GLOBAL_BATCH, "window": WINDOW,
        "speeds": SPEEDS, "emulation": emulation_mode(),
        "targets": {"within_fraction_of_grid_best": 1.0 - WITHIN, "max_fraction_of_grid_experiments":
                    EXPERIMENT_FRACTION},
        "load_balancing_speedup": lb, "clusters": [], "work_dir": work if keep else None,
    }
    try:
        for cluster in clusters:
            grid, grid_seconds = run_grid(cluster, os.path.join(work, cluster, "grid"))
            tuners = [run_tuner(cluster, mode, os.path.join(work, cluster, mode)) for mode in modes]
            report["clusters"].append(summarise(cluster, grid, grid_seconds, tuners, lb))
            _write(report, began, load_start)  # a partial report survives a later failure
    finally:
        removed = clean_shm(work)
        if removed:
            print(f"removed {removed} /dev/shm all-reduce buffer(s) left by this benchmark's runs")
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    _write(report, began, load_start)
    print_table(report)
    print(f"JSON written to {RESULTS}")
    return report


def _write(report, began, load_start):
    report["total_wall_seconds"] = time.monotonic() - began
    report["load_average"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))


def run_pruning(repeats, keep=False):
    """Fast mode with and without plan pruning, alternately, on the emulated cluster (no grid)."""
    began = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    work = tempfile.mkdtemp(prefix="bench_autotuning_pruning_")
    runs = {"fast": [], "fast_unpruned": []}
    try:
        for repeat in range(repeats):
            for mode in runs:
                row = run_tuner("emulated", mode, os.path.join(work, f"{mode}_{repeat}"))
                row.pop("profile", None)
                runs[mode].append(row)
                done = repeat * len(runs) + list(runs).index(mode) + 1
                print(f"[{time.monotonic() - began:5.0f} s] run {done}/{repeats * len(runs)} {mode}: "
                      f"{row.get('experiments_run')} experiments, pruned {row.get('pruned')}, chosen "
                      f"{row.get('chosen')} at {row.get('best_throughput') or 0:.1f} samples/s, other load "
                      f"{_cores(row.get('other_load_cores'))} cores", flush=True)
    finally:
        clean_shm(work)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {mode: {"experiments_run": [r.get("experiments_run") for r in rows],
                      "chosen": [r.get("chosen") for r in rows],
                      "best_throughput": [r.get("best_throughput") for r in rows],
                      "tuning_seconds": [r.get("tuning_seconds") for r in rows]} for mode, rows in runs.items()}
    report = {"cluster": "emulated", "description": CLUSTERS["emulated"]["description"], "speeds": SPEEDS,
              "zero_stages": STAGES, "train_batch_size": GLOBAL_BATCH, "summary": summary, "runs": runs,
              "total_wall_seconds": time.monotonic() - began,
              "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}}
    PRUNING_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    PRUNING_RESULTS.write_text(json.dumps(report, indent=2))
    for mode, row in summary.items():
        print(f"{mode:14s} experiments {row['experiments_run']}, chosen {row['chosen']}, "
              f"samples/s {[round(v or 0, 1) for v in row['best_throughput']]}, tuning s "
              f"{[round(v or 0) for v in row['tuning_seconds']]}")
    print(f"JSON written to {PRUNING_RESULTS}")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--keep", action="store_true", help="keep the experiments' folders (printed in the JSON)")
    parser.add_argument("--pruning", action="store_true", help="fast mode with and without plan pruning, no grid")
    parser.add_argument("--repeats", type=int, default=1, help="with --pruning: runs of each mode")
    arguments = parser.parse_args()
    os.chdir(REPO)
    if arguments.pruning:
        run_pruning(arguments.repeats, keep=arguments.keep)
    else:
        run(arguments.clusters, arguments.modes, keep=arguments.keep)
