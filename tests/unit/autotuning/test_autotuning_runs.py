# SPDX-License-Identifier: Apache-2.0
"""``deepspeed --autotuning tune|run`` end to end, on this machine's CPU ranks, no pdsh or ssh.

Every run here is real: the launcher, deepspeed.initialize, gloo, the experiments' own
launchers. Spaces are tiny (a small MLP, windows of two or four steps) to keep the time in CI
down; each experiment costs ~15-25 s of start-up on two cores.
"""

import json
import re
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from harness import _merged_environ, deepspeed_launcher, fork_environment, launch_deepspeed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parent / "tiny_train.py"


def _env():
    return _merged_environ({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, fork_environment())


def _config(**autotuning):
    block = {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "experiment_timeout": 240}
    block.update(autotuning)
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
        "autotuning": block,
    }


def _tune(tmp_path, config, script_args=(), mode="tune", timeout=800, script=SCRIPT, num_gpus=2):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config, indent=2))
    command = [deepspeed_launcher(), "--autotuning", mode, "--num_nodes", "1", "--num_gpus", str(num_gpus),
               str(script), "--deepspeed_config", str(path), *map(str, script_args)]
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _results(tmp_path):
    return json.loads((tmp_path / "autotuning_results" / "results.json").read_text())


def _live_processes(marker):
    """Processes whose command line contains ``marker`` (this test's temporary directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


def test_metric_is_a_window_mean_from_every_rank_and_upstream_takes_one_step_on_rank_0(pristine_upstream, tmp_path):
    """Upstream: the metric comes from the last optimizer step's timers on rank 0, and there is no
    'flops' key for metric 'flops' (KeyError). The forward here sleeps 0.05 s and 0.25 s on
    alternate steps, so one step's time is far from the window's mean (0.15 s + compute)."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
              "zero_optimization": {"stage": 1},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 5}}

    def run(label, root, env):
        metric_path = tmp_path / f"{label}.json"
        path = tmp_path / f"{label}_config.json"
        path.write_text(json.dumps({**config, "autotuning": {**config["autotuning"], "metric_path": str(metric_path)}}))
        code, output = launch_deepspeed(SCRIPT, ["--deepspeed_config", path, "--sleep-schedule", "0.05,0.25"],
                                        timeout=300, env=env, cwd=root)
        assert code == 0, f"{label}: {output[-4000:]}"
        return json.loads(metric_path.read_text())

    # Side by side: the sleeps dominate the steps, so sharing the cores does not blur them.
    with ThreadPoolExecutor(max_workers=2) as pool:
        fork = pool.submit(run, "fork", None, None)
        upstream = pool.submit(run, "upstream", pristine_upstream.root, pristine_upstream.env)
        fork, upstream = fork.result(), upstream.result()
    steps = fork["step_seconds"]
    assert len(steps) == 4 == fork["window_steps"]
    # What the sleeps guarantee, whatever else the machine runs: the 0.25 s steps are visible step by
    # step, and the latency is the slowest rank's window mean, so never below rank 0's (the mean of
    # 0.05, 0.25, 0.05, 0.25 is 0.15). How close to 0.15 it comes on a loaded machine is no test's.
    assert max(steps) >= 0.25
    assert fork["latency"] == pytest.approx(max(rank["step_seconds"] for rank in fork["ranks"]))
    assert fork["latency"] >= statistics.mean(steps) * (1 - 1e-9) and fork["latency"] >= 0.15
    assert fork["throughput"] == pytest.approx(8 / fork["latency"])
    assert fork["flops"] > 0 and fork["flops"] == fork["FLOPS_per_gpu"]
    assert [rank["rank"] for rank in fork["ranks"]] == [0, 1]
    assert all(rank["peak_memory_bytes"] > 0 and rank["micro_batch_size"] == 4 for rank in fork["ranks"])
    # The CPU accelerator's "device memory" is the host's RAM: two ranks share it.
    assert all(rank["memory_capacity_bytes"] <= 0.51 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
               for rank in fork["ranks"])
    # Upstream, same run: no 'flops' key, rank 0 only, and the time of the last (slow) step.
    assert "flops" not in upstream and "ranks" not in upstream
    assert 8 / upstream["throughput"] > 0.24


def test_tune_then_run_on_an_emulated_mixed_cluster(tmp_path):
    """Rank 1 runs at 0.4 (time dilation); the tuner profiles both ranks once, predicts the
    candidates, runs few, and writes the per-rank plan; 'run' then trains with it. A script that
    prints 'error' on stderr is not a failed experiment."""
    config = _config(fast=True, metric="throughput")
    config.update(train_batch_size=16, zero_optimization={"stage": 1, "contiguous_gradients": False},
                  heterogeneous_config={"enabled": True,
                                        "emulation": {"speeds": [1.0, 0.4], "memory_gb": [16, 8],
                                                      "mode": "dilation"}})
    code, output = _tune(tmp_path, config, ["--sleep-per-sample", "0.004", "--print-error", "--steps", "12"],
                         mode="run")
    assert code == 0, output[-6000:]
    results = _results(tmp_path)
    ran = [e for e in results["experiments"] if e["status"] != "predicted out of memory"]
    assert all(e["status"] == "ok" for e in ran), ran
    assert 2 <= len(ran) <= 4  # the profiling run, the stage's best prediction, its runner-up
    for line in ("| tuning space | experiments | best metric value (throughput) | best experiment name |",
                 "| z1 ", "| global "):
        assert line in output
    assert "[autotuning] experiment 1 (profiling run) profile_z1_gas1_tbs16: running" in output
    assert "[autotuning] experiment 2 of " in output and " planned so far " in output and "ETA" in output
    # The profiling run measured its collectives: the bandwidth other stages' communication is predicted at.
    assert re.search(r"collectives: [\d.]+ ms per step at ZeRO-1, [\d.]+ MiB/s per rank", output), output[-6000:]
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    plan = optimal["heterogeneous_config"]
    assert optimal["train_batch_size"] == 16 and optimal["zero_optimization"]["stage"] == 1
    assert optimal["zero_optimization"]["contiguous_gradients"] is False  # the user's ZeRO settings kept
    assert optimal["autotuning"]["enabled"] is False and "train_micro_batch_size_per_gpu" not in optimal
    assert plan["emulation"]["speeds"] == [1.0, 0.4]
    sizes = plan.get("micro_batch_sizes")
    assert plan["load_balancing_strategy"] == "manual" and sum(sizes) == 16 and sizes[0] > sizes[1], plan
    best = max((e for e in ran), key=lambda e: e["value"])
    assert sizes == best["micro_batch_sizes"]
    assert (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text().count("ds_config_optimal.json") == 1
    for experiment in ran:
        folder = Path(experiment["folder"])
        assert folder.parent == tmp_path / "autotuning_exps"
        assert {"ds_config.json", "cmd.txt", "stdout.log", "stderr.log", "metrics.json"} <= set(os.listdir(folder))
        # Found by the name the summary shows (the profiling run's folder has a link under its plan's name).
        assert (folder.parent / experiment["name"]).resolve() == folder.resolve()
    assert "launching the optimal configuration" in output
    assert "training finished after 12 steps" in output  # 'run' trained with it, without stopping


PIPELINE_SCRIPT = Path(__file__).resolve().parent / "tiny_pipeline_train.py"


def test_tune_then_run_a_pipeline_degree_and_partition_on_an_emulated_cluster(tmp_path):
    """A PipelineModule of 6 layers on 2 ranks, rank 1 at half speed: one stage (2 replicas, the
    compute_aware plan splits the batch) against two stages cut by the fork's balanced partition and
    by upstream's parameters partition. Each experiment's degree reaches the script as --stages."""
    config = _config(arg_mappings={"pipeline.num_stages": "--stages"},
                     pipeline={"num_stages": [1, 2], "partition": ["balanced", "parameters"]})
    config.update(train_batch_size=16, gradient_accumulation_steps=4, zero_optimization={"stage": 1},
                  heterogeneous_config={"enabled": True, "emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}})
    del config["train_micro_batch_size_per_gpu"]
    code, output = _tune(tmp_path, config, ["--sleep-per-sample", "0.002", "--steps", "8"], mode="run",
                         script=PIPELINE_SCRIPT, timeout=400)
    assert code == 0, output[-6000:]
    assert "[autotuning] pipeline: no profiling run" in output
    experiments = {e["name"]: e for e in _results(tmp_path)["experiments"]}
    assert set(experiments) == {"pp1_z1_gas4_tmbspg2", "pp2bal_z1_gas4_tmbspg4", "pp2par_z1_gas4_tmbspg4"}
    assert all(e["status"] == "ok" for e in experiments.values()), experiments
    for name, (degree, partition) in {"pp1_z1_gas4_tmbspg2": (1, None), "pp2bal_z1_gas4_tmbspg4": (2, "balanced"),
                                      "pp2par_z1_gas4_tmbspg4": (2, "parameters")}.items():
        folder = tmp_path / "autotuning_exps" / name
        hetero = json.loads((folder / "ds_config.json").read_text())["heterogeneous_config"]
        assert (hetero.get("pipeline") or {}).get("partition") == partition
        assert (experiments[name]["pipeline_stages"], experiments[name]["partition"]) == (degree, partition)
        assert (folder / "cmd.txt").read_text().split()[-2:] == ["--stages", str(degree)]
        log = (folder / "stdout.log").read_text()
        assert f"pipeline: {degree} stage(s) x {2 // degree} replica(s)" in log  # the engine built that degree
    # One stage, two replicas: rank 1 at half speed gets the smaller share of each micro-step.
    sizes = experiments["pp1_z1_gas4_tmbspg2"]["micro_batch_sizes"]
    assert sum(sizes) == 4 and sizes[0] > sizes[1], sizes
    for row in ("| pp1 ", "| pp2 balanced ", "| pp2 parameters ", "| global "):
        assert row in output
    best = max(experiments.values(), key=lambda e: e["value"])
    assert f"best {best['name']}: throughput" in output
    assert f"cmd_optimal.txt passes --stages {best['pipeline_stages']}" in output
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert (optimal["heterogeneous_config"].get("pipeline") or {}).get("partition") == best["partition"]
    assert optimal["zero_optimization"]["stage"] == 1 and optimal["autotuning"]["enabled"] is False
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text().split()
    assert command[-2:] == ["--stages", str(best["pipeline_stages"])]
    # 'run' trained the best degree with the written config.
    assert f"training finished after 8 steps with {best['pipeline_stages']} stage(s)" in output


def test_gridsearch_on_latency_keeps_user_zero_settings_and_picks_the_smallest(tmp_path):
    """Non-fast mode (upstream: no hostfile, KeyError) with metric latency (upstream: the largest
    latency won). No stage named: ZeRO 0-3 would be tuned (upstream: only 0); here two are named."""
    config = _config(fast=False, tuner_type="gridsearch", metric="latency")
    config.update(train_micro_batch_size_per_gpu=[2], zero_optimization={"stage": [0, 1], "reduce_bucket_size": 123456})
    code, output = _tune(tmp_path, config, ["--sleep-per-sample", "0.002"])
    assert code == 0, output[-6000:]
    results = _results(tmp_path)
    experiments = {e["name"]: e for e in results["experiments"]}
    assert {"z0_gas1_tmbspg2", "z1_gas1_tmbspg2"} <= set(experiments)
    assert experiments["z0_gas1_tmbspg2"]["status"] == experiments["z1_gas1_tmbspg2"]["status"] == "ok"
    profile = [e for e in results["experiments"] if e["name"].startswith("profile_")]
    assert profile and profile[0]["status"] == "profiling only"  # heterogeneous_config is off: not a candidate
    fastest = min(("z0_gas1_tmbspg2", "z1_gas1_tmbspg2"), key=lambda n: experiments[n]["value"])
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert summary.splitlines()[-2].split("|")[4].strip() == fastest
    for name in ("z0_gas1_tmbspg2", "z1_gas1_tmbspg2"):
        exp_config = json.loads((tmp_path / "autotuning_exps" / name / "ds_config.json").read_text())
        assert exp_config["zero_optimization"]["reduce_bucket_size"] == 123456
        assert "heterogeneous_config" not in exp_config


@pytest.mark.parametrize("case", ["missing_script", "no_autotuning_block", "unknown_key", "zero_gpus",
                                  "per_rank_list"])
def test_bad_input_is_refused_before_any_launch(tmp_path, case):
    config = _config()
    script, num_gpus = SCRIPT, 2
    if case == "missing_script":
        script = tmp_path / "no_such_train.py"
    elif case == "no_autotuning_block":
        del config["autotuning"]
    elif case == "unknown_key":
        config["autotuning"]["fast_mode"] = True
    elif case == "zero_gpus":
        num_gpus = 0
    else:  # speeds for 3 ranks on a 2-rank command: upstream-style tuning failed only in the experiments
        config["heterogeneous_config"] = {"enabled": True, "emulation": {"speeds": [1.0, 0.5, 0.5]}}
    code, output = _tune(tmp_path, config, script=script, timeout=120, num_gpus=num_gpus)
    assert code == 2, output[-3000:]
    expected = {"missing_script": "no_such_train.py", "no_autotuning_block": "'autotuning' block",
                "unknown_key": "unknown key(s) ['fast_mode']", "zero_gpus": "--num_gpus 0: give a positive number",
                "per_rank_list": "heterogeneous_config.emulation.speeds has 3 entries but the data-parallel world "
                                 "has 2 ranks"}[case]
    assert "deepspeed autotuning: error:" in output and expected in output, output[-3000:]
    assert not (tmp_path / "autotuning_exps").exists() or not any((tmp_path / "autotuning_exps").iterdir())


@pytest.mark.parametrize("case", ["ignores_deepspeed", "unknown_flag"])
def test_a_script_that_cannot_be_tuned_stops_after_two_experiments(tmp_path, case):
    config = _config()
    config["zero_optimization"] = {"stage": [1]}
    config["autotuning"]["train_micro_batch_size_per_gpu"] = [2, 4]
    args = []
    if case == "ignores_deepspeed":
        args = ["--ignore-deepspeed"]
    else:
        config["autotuning"]["arg_mappings"] = {"gradient_accumulation_steps": "--grad-accum"}
    code, output = _tune(tmp_path, config, args)
    assert code == 1, output[-4000:]
    expected = {"ignores_deepspeed": "exited 0 without writing metrics",
                "unknown_flag": "unrecognized arguments: --grad-accum"}[case]
    assert expected in output, output[-4000:]
    if case == "unknown_flag":
        assert "hint: autotuning.arg_mappings" in output
    results = _results(tmp_path)
    assert len(results["experiments"]) == 2  # stopped early, and says what it tried
    assert all((tmp_path / "autotuning_exps" / e["name"] / "stderr.log").is_file() for e in results["experiments"])


def test_every_candidate_out_of_memory_is_reported_as_such(tmp_path):
    config = _config()
    config["zero_optimization"] = {"stage": [1]}
    config["autotuning"]["train_micro_batch_size_per_gpu"] = [2, 4]
    code, output = _tune(tmp_path, config, ["--oom-above", "1"])
    assert code == 1, output[-4000:]
    assert "every candidate ran out of memory" in output
    statuses = [e["status"] for e in _results(tmp_path)["experiments"]]
    assert statuses and set(statuses) == {"out of memory"}, statuses
    assert "can't allocate memory for a micro-batch" in _results(tmp_path)["experiments"][0]["error"]


def test_build_time_is_not_counted_a_hang_is_killed_and_an_interrupted_tuner_leaves_no_rank_or_lock(tmp_path):
    """Each experiment first "JIT-builds" an op for 30 s, holding torch's build lock as a real
    build does. The first then hangs: it is killed after 45 s of its own time, the build not
    counted. The tuner is interrupted (SIGINT) while the second builds: it stops that one too and
    says so, and the build lock the killed rank held is removed (torch's lock names no owner;
    left behind, every later load of that op would wait on it forever)."""
    config = _config(experiment_timeout=45)
    config["zero_optimization"] = {"stage": [1]}
    config["autotuning"]["train_micro_batch_size_per_gpu"] = [2]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    log = tmp_path / "tuner.log"
    prefix = f"autotuning_build_test_{os.getpid()}"
    extensions = Path(_env()["TORCH_EXTENSIONS_DIR"])
    command = [deepspeed_launcher(), "--autotuning", "tune", "--num_gpus", "2", str(SCRIPT), "--deepspeed_config",
               str(path), "--hang-at-step", "2", "--build-seconds", "30", "--build-op", prefix]
    try:
        with open(log, "w") as out:
            tuner = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 420
                while "building op" not in _second_experiment_log(tmp_path) and time.monotonic() < deadline:
                    assert tuner.poll() is None, log.read_text()[-4000:]
                    time.sleep(0.2)
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                tuner.send_signal(signal.SIGINT)
                code = tuner.wait(timeout=60)
            finally:
                if tuner.poll() is None:
                    tuner.kill()
        output = log.read_text()
        assert code == 130, output[-4000:]
        assert "interrupted; the running experiment was stopped; partial results of the 1 finished" in output
        assert _results(tmp_path)["interrupted"] is True
        assert (tmp_path / "autotuning_results" / "summary.txt").read_text().startswith("INTERRUPTED")
        experiments = _results(tmp_path)["experiments"]
        assert [e["status"] for e in experiments] == ["timed out"], experiments
        error = experiments[0]["error"]
        assert "experiment_timeout" in error, error
        not_counted = float(error.split(" s of JIT op builds not counted")[0].rsplit("(", 1)[1])
        # The builds sleep 30 s holding the lock: at least that much was seen (how much more a loaded
        # machine adds is not the tuner's).
        assert not_counted >= 25, error
        assert experiments[0]["seconds"] >= 45 + not_counted - 2, experiments[0]  # the build was not counted
        assert sorted(extensions.glob(f"{prefix}_*/lock")) == []
        assert len(list(extensions.glob(f"{prefix}_*"))) == 2  # both experiments built
        assert _live_processes(str(tmp_path)) == []
    finally:
        for folder in extensions.glob(f"{prefix}_*"):
            shutil.rmtree(folder, ignore_errors=True)


def _second_experiment_log(tmp_path):
    folders = [p for p in (tmp_path / "autotuning_exps").glob("z*") if (p / "stdout.log").is_file()]
    return folders[0].joinpath("stdout.log").read_text() if folders else ""


def test_a_metrics_file_left_by_an_earlier_run_is_never_read(tmp_path, monkeypatch):
    """Upstream's smaller-micro-batch loop re-read the previous experiment's metrics file."""
    from deepspeed.autotuning.heterogeneous.results import NO_METRICS
    from deepspeed.autotuning.heterogeneous.runner import ExperimentRunner
    from deepspeed.autotuning.heterogeneous.experiment import Experiment
    from deepspeed.autotuning.heterogeneous.settings import parse_settings

    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(0)\n")
    exp_dir = tmp_path / "exps" / "z1_gas1_tmbspg2"
    exp_dir.mkdir(parents=True)
    stale = exp_dir / "metrics.json"
    stale.write_text(json.dumps({"throughput": 1e9, "latency": 1e-9}))
    user = _config()
    experiment = Experiment(stage=1, gas=1, micro_batch_sizes=(2, 2))
    config = experiment.ds_config(user, str(stale), parse_settings(user))
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    runner = ExperimentRunner(["--num_gpus", "2"], str(script), ["--deepspeed_config", "ds.json"], {}, timeout=120)
    status, message, metrics, _ = runner.run(experiment, config, str(exp_dir))
    assert (status, metrics) == (NO_METRICS, None), message
    assert not stale.exists()
