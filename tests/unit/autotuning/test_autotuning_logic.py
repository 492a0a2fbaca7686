# SPDX-License-Identifier: Apache-2.0
"""The autotuner's pure parts: settings, space, experiment configs, selection, failure
classification, the cost model, the model-based choice, the summary and the lr advice.
Each upstream defect named in the issue has a test here or in test_autotuning_runs.py."""

import json
from dataclasses import replace
import random

import pytest

from deepspeed.autotuning.heterogeneous import results as R
from deepspeed.autotuning.heterogeneous.costmodel import ClusterProfile
from deepspeed.runtime.heterogeneous.measure.devices import rank_memory_capacity
from deepspeed.autotuning.heterogeneous.runner import (experiment_args, extension_roots, find_config_path,
                                                       orphaned_build_locks, remove_build_locks)
from deepspeed.autotuning.heterogeneous.search import TuningSearch
from deepspeed.autotuning.heterogeneous.experiment import (Experiment, interpolate, optimal_ds_config,
                                                           replica_micro_batches)
from deepspeed.autotuning.heterogeneous.settings import AutotuningConfigError, parse_settings
from deepspeed.autotuning.heterogeneous.space import parse_space
from deepspeed.autotuning.heterogeneous.tuner import EXPLORATION, _launcher_args, _master_port, choose_next
from deepspeed.runtime.heterogeneous.planning.planner import TimeModel


def _config(**block):
    return {"train_micro_batch_size_per_gpu": "auto", "autotuning": {"enabled": True, **block}}


# -- settings and space --------------------------------------------------------------------------


@pytest.mark.parametrize("block, words", [
    ({"metric": "speed"}, "autotuning.metric = 'speed': use one of throughput, latency, flops"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type = 'bayes'"),
    ({"fastt": True}, "unknown key(s) ['fastt']"),
    ({"start_profile_step": 5, "end_profile_step": 5}, "end_profile_step (5) must exceed start_profile_step (5)"),
    ({"experiment_timeout": 0}, "autotuning.experiment_timeout = 0"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "batch"}}, "autotuning.arg_mappings"),
    ({"arg_mappings": {"lr": "--lr"}}, "['lr'] cannot be mapped"),
])
def test_bad_settings_name_the_key_and_what_is_allowed(block, words):
    with pytest.raises(AutotuningConfigError, match=None) as error:
        parse_settings(_config(**block))
    assert words in str(error.value)


def test_no_stage_named_tunes_every_stage_and_named_stages_are_kept():
    settings = parse_settings(_config())
    assert parse_space(_config(), settings, 2).stages == [0, 1, 2, 3]  # upstream: ZeRO-0 only
    named = {**_config(), "zero_optimization": {"stage": [2, 1]}}
    assert parse_space(named, settings, 2).stages == [1, 2]
    inside = _config(zero_optimization={"stage": 3})
    assert parse_space(inside, settings, 2).stages == [3]
    with pytest.raises(AutotuningConfigError, match="zero_optimization.stage = \\[4\\]"):
        parse_space({**_config(), "zero_optimization": {"stage": [4]}}, settings, 2)


def test_space_lists_and_fixed_global_batch():
    settings = parse_settings(_config())
    space = parse_space({**_config(train_micro_batch_size_per_gpu=[8, 2, 4]), "gradient_accumulation_steps": [1, 2]},
                        settings, 2)
    assert space.micro_batch_sizes == [2, 4, 8] and space.gas == [1, 2] and space.train_batch_size is None
    six = {**_config(), "train_batch_size": 6, "gradient_accumulation_steps": [1, 2, 3, 4]}
    hetero = {**six, "heterogeneous_config": {"enabled": True}}
    assert parse_space(hetero, settings, 2).gas == [1, 2, 3]  # 4 does not divide 6; 3 samples split 2-1
    assert parse_space(six, settings, 2).gas == [1, 3]  # uniform: 3 samples per micro-step do not split in 2
    with pytest.raises(AutotuningConfigError, match=r"autotuning.train_micro_batch_size_per_gpu = \[0\]"):
        parse_space(_config(train_micro_batch_size_per_gpu=[0]), settings, 2)


def test_a_fixed_global_batch_and_listed_sizes_give_the_accumulation_steps():
    """Upstream derives gas from a fixed train_batch_size and each micro-batch size; sizes that
    cannot give the batch were silently replaced (mbs [3] with batch 8 ran mbs 4)."""
    settings = parse_settings(_config())
    listed = {**_config(train_micro_batch_size_per_gpu=[2, 4, 3]), "train_batch_size": 16,
              "gradient_accumulation_steps": "auto"}
    assert parse_space(listed, settings, 2).gas == [2, 4]  # 16 = 2 ranks x 4 x 2 = 2 x 2 x 4; 3 gives none
    with pytest.raises(AutotuningConfigError) as info:
        parse_space({**listed, "train_batch_size": 8, "autotuning": {**listed["autotuning"],
                                                                      "train_micro_batch_size_per_gpu": [3]}},
                    settings, 2)
    assert "none of autotuning.train_micro_batch_size_per_gpu [3] gives it on 2 ranks" in str(info.value)
    assert "list sizes from [1, 2, 4]" in str(info.value)
    with pytest.raises(AutotuningConfigError, match="cannot be split evenly over 2 ranks.*heterogeneous_config"):
        parse_space({**_config(), "train_batch_size": 7}, settings, 2)
    assert parse_space({**_config(), "train_batch_size": 7, "heterogeneous_config": {"enabled": True}},
                       settings, 2).gas == [1]
    with pytest.raises(AutotuningConfigError, match="smaller than the 2 data-parallel ranks"):
        parse_space({**_config(), "train_batch_size": 1}, settings, 2)


def test_experiment_config_keeps_the_users_zero_settings_and_removes_tuning_values():
    """Upstream replaced zero_optimization by {"stage": n}, dropping offload and bucket sizes."""
    user = {**_config(train_micro_batch_size_per_gpu=[2, 4], fast=True),
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": [1, 2], "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 7},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    settings = parse_settings(user)
    config = Experiment(stage=2, gas=2, micro_batch_sizes=(4, 4)).ds_config(user, "/x/metrics.json", settings)
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 7}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 2, 16)
    assert "train_micro_batch_size_per_gpu" not in config["autotuning"] and config["autotuning"]["metric_path"] == \
        "/x/metrics.json"
    assert '"auto"' not in json.dumps(config)
    assert user["zero_optimization"]["stage"] == [1, 2]  # the user's dict is not modified


def test_heterogeneous_experiment_config_carries_the_plan_and_the_emulation():
    user = {**_config(), "heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.4]},
                                                  "scheduler": {"dynamic_rebalancing": True}}}
    settings = parse_settings(user)
    config = Experiment(stage=1, gas=1, micro_batch_sizes=(12, 4), heterogeneous=True).ds_config(user, "m", settings)
    hetero = config["heterogeneous_config"]
    assert hetero["load_balancing_strategy"] == "manual" and hetero["micro_batch_sizes"] == [12, 4]
    assert hetero["emulation"] == {"speeds": [1.0, 0.4]} and hetero["scheduler"]["dynamic_rebalancing"] is False
    assert "train_micro_batch_size_per_gpu" not in config and config["train_batch_size"] == 16
    uniform = Experiment(stage=1, gas=1, micro_batch_sizes=(8, 8), heterogeneous=True).ds_config(user, "m", settings)
    assert uniform["heterogeneous_config"]["load_balancing_strategy"] == "uniform"
    assert Experiment(stage=1, gas=2, micro_batch_sizes=(12, 4)).name == "z1_gas2_tmbspg12-4"
    assert Experiment(stage=0, gas=1, micro_batch_sizes=(3, 3)).name == "z0_gas1_tmbspg3"


def test_optimal_config_trains_and_gives_back_the_users_scheduler():
    from deepspeed.runtime.heterogeneous.config.settings import HeterogeneousConfig
    fixed = {**_config(), "heterogeneous_config": {"enabled": True, "scheduler": {"imbalance_threshold": 0.2}}}
    dynamic = {**_config(), "heterogeneous_config": {"enabled": True, "scheduler": {"type": "compute_aware",
                                                                                    "dynamic_rebalancing": True}}}
    experiment = Experiment(stage=1, gas=1, micro_batch_sizes=(12, 4), heterogeneous=True)
    for user, strategy in ((fixed, "manual"), (dynamic, "compute_aware")):
        config = optimal_ds_config(experiment.ds_config(user, "m.json", parse_settings(user)), user)
        assert config["autotuning"]["enabled"] is False and "metric_path" not in config["autotuning"]
        hetero = config["heterogeneous_config"]
        assert hetero["load_balancing_strategy"] == strategy and config["train_batch_size"] == 16
        HeterogeneousConfig(**hetero)  # valid as the fork's config block
    assert optimal_ds_config(experiment.ds_config(fixed, "m", parse_settings(fixed)), fixed)[
        "heterogeneous_config"]["scheduler"] == {"imbalance_threshold": 0.2}
    assert optimal_ds_config(experiment.ds_config(dynamic, "m", parse_settings(dynamic)), dynamic)[
        "heterogeneous_config"]["scheduler"]["dynamic_rebalancing"] is True


def test_interpolate_keeps_the_sum_and_stays_positive():
    assert interpolate((8, 8), (12, 4), 1.0) == (12, 4)
    assert interpolate((8, 8), (12, 4), 0.5) == (10, 6)
    assert interpolate((8, 8), (12, 4), 1.5) == (14, 2)
    assert interpolate((8, 8), (12, 4), 2.5) is None
    assert sum(interpolate((5, 5, 5), (9, 4, 2), 0.7)) == 15


# -- arguments -----------------------------------------------------------------------------------


def test_experiment_arguments_replace_the_config_and_set_mapped_flags():
    experiment = Experiment(stage=1, gas=2, micro_batch_sizes=(6, 2))
    args = ["--deepspeed_config", "ds.json", "--per_device_train_batch_size", "1", "--x"]
    out = experiment_args(args, "/e/ds_config.json", {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                                                     "gradient_accumulation_steps": "--gas"}, experiment)
    assert out == ["--deepspeed_config", "/e/ds_config.json", "--per_device_train_batch_size", "6", "--x", "--gas", "2"]
    assert find_config_path(["--deepspeed", "--deepspeed_config=a.json"]) == "a.json"
    assert experiment_args(["--deepspeed_config=a.json"], "b.json", {}, experiment) == ["--deepspeed_config=b.json"]
    with pytest.raises(AutotuningConfigError, match="do not name a ds_config"):
        experiment_args(["--lr", "1"], "b.json", {}, experiment)


def test_only_unheld_build_locks_created_during_the_experiment_are_removed(tmp_path):
    """torch's JIT lock names no owner: a rank killed mid-build leaves it, and later runs wait
    forever. Its builder keeps the lock's descriptor open, so a live build is told apart."""
    import os
    import time
    from torch.utils.file_baton import FileBaton
    started = time.time()
    old = tmp_path / "older_op" / "lock"
    new = tmp_path / "fused_adam" / "lock"  # under TORCH_EXTENSIONS_DIR
    nested = tmp_path / "py311_cpu" / "heterogeneous" / "lock"  # under torch's default root
    held = tmp_path / "other_job_op" / "lock"  # another job's build, running now
    for path in (old, new, nested, held):
        path.parent.mkdir(parents=True)
    for path in (old, new, nested):
        path.write_text("")
        os.utime(path, (started + 5, started + 5))
    os.utime(old, (started - 60, started - 60))
    baton = FileBaton(str(held))
    assert baton.try_acquire()
    try:
        assert remove_build_locks([str(tmp_path)], started) == [str(new), str(nested)]
        assert old.exists() and held.exists() and not new.exists() and not nested.exists()
        assert orphaned_build_locks([str(tmp_path)]) == [str(old)]  # named when an experiment times out
    finally:
        baton.release()
    assert extension_roots({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == [str(tmp_path)]
    assert extension_roots({})[0].endswith("torch_extensions")


def test_launcher_arguments_drop_autotuning_and_the_port():
    argv = ["--autotuning", "tune", "--num_nodes", "1", "--num_gpus", "2", "--master_port", "29500", "train.py",
            "--deepspeed_config", "ds.json"]
    assert _launcher_args(argv, "train.py") == ["--num_nodes", "1", "--num_gpus", "2"]


def test_the_users_master_port_is_where_the_experiments_count_from():
    from deepspeed.autotuning.heterogeneous.runner import ExperimentRunner
    argv = ["--autotuning", "tune", "--num_gpus", "2", "--master_port", "29600", "train.py", "--master_port", "1"]
    assert _master_port(argv, "train.py") == 29600  # the script's own flags are not the launcher's
    assert _master_port(["--master_port=29700", "train.py"], "train.py") == 29700
    assert _master_port(["--num_gpus", "2", "train.py"], "train.py") is None
    with pytest.raises(AutotuningConfigError, match="--master_port 'x'"):
        _master_port(["--master_port", "x", "train.py"], "train.py")
    runner = ExperimentRunner([], "train.py", [], {}, 60, base_port=29600)
    assert [runner.next_port() for _ in range(3)] == [29600, 29601, 29602]
    free = ExperimentRunner([], "train.py", [], {}, 60).next_port()
    assert 0 < free < 65536


def test_only_orphaned_shared_memory_buffers_are_removed():
    import os
    import time
    from deepspeed.autotuning.heterogeneous.runner import remove_orphaned_shm_buffers
    tag = f"autotuning_test_{os.getpid()}"
    paths = {name: f"/dev/shm/deepspeed_allreduce_buffer_{tag}_127.0.0.1_{port}_0"
             for name, port in (("orphaned", 1), ("mapped", 2), ("new", 3))}
    try:
        for path in paths.values():
            with open(path, "wb") as handle:
                handle.write(b"x")
        old = time.time() - 600
        for name in ("orphaned", "mapped"):
            os.utime(paths[name], (old, old))
        removed = remove_orphaned_shm_buffers(min_age_s=60, mapped={paths["mapped"]})
        assert paths["orphaned"] in removed and not os.path.exists(paths["orphaned"])
        assert os.path.exists(paths["mapped"]) and os.path.exists(paths["new"])  # in use, or just created
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


# -- outcomes ------------------------------------------------------------------------------------


def _outcome(name, value, status=R.OK, stage=1):
    return R.Outcome(name=name, stage=stage, status=status, value=value)


def test_latency_picks_the_smallest_and_throughput_the_largest():
    """Upstream chose the largest latency."""
    outcomes = [_outcome("a", 3.0), _outcome("b", 1.0), _outcome("c", 2.0), _outcome("d", 0.5, R.FAILED)]
    assert R.select_best(outcomes, "latency").name == "b"
    assert R.select_best(outcomes, "throughput").name == "a"
    assert R.select_best(outcomes, "flops").name == "a"
    assert R.select_best([_outcome("x", None, R.OOM)], "latency") is None


def test_flops_metric_is_read_from_the_metrics_file():
    """Upstream looked up results['flops'], which its engine never wrote (KeyError)."""
    assert R.metric_value({"flops": 5.0, "FLOPS_per_gpu": 5.0}, "flops") == 5.0
    assert R.metric_value({"FLOPS_per_gpu": 7.0}, "flops") == 7.0
    with pytest.raises(ValueError, match="no finite 'latency'"):
        R.metric_value({"throughput": 1.0}, "latency")


def test_exit_status_decides_failure_not_the_word_error():
    """Upstream marked a run failed when any stderr line contained 'error'."""
    assert R.classify(0, "UserWarning: error-prone API\nerror: nothing", metrics_present=True) == (R.OK, "")
    status, message = R.classify(0, "", metrics_present=False)
    assert status == R.NO_METRICS and "without writing metrics" in message
    status, message = R.classify(1, "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out "
                                 "of memory. Tried to allocate 2.00 GiB")
    assert status == R.OOM and "Tried to allocate 2.00 GiB" in message
    status, message = R.classify(1, "noise\nTraceback (most recent call last):\n  File \"t.py\"\nValueError: bad "
                                 "shape (3, 4)")
    assert status == R.FAILED and message.endswith("ValueError: bad shape (3, 4)") and "noise" not in message
    assert R.classify(-9, "", timed_out=True)[0] == R.TIMEOUT
    assert R.classify(137, "Killed")[0] == R.OOM


def test_cpu_memory_is_divided_among_the_ranks_on_a_host():
    """Upstream gave every rank the whole host's RAM on the CPU accelerator."""
    assert rank_memory_capacity(64 * 2**30, "cpu", 4) == 16 * 2**30
    assert rank_memory_capacity(80 * 2**30, "cuda", 8) == 80 * 2**30
    assert rank_memory_capacity(None, "cpu", 2) is None


def test_summary_table_has_a_row_per_stage_and_a_global_row():
    outcomes = [_outcome("z0_gas1_tmbspg4", 10.0, stage=0), _outcome("z1_gas1_tmbspg8", 12.5, stage=1),
                _outcome("z1_gas1_tmbspg16", None, R.OOM, stage=1),
                R.Outcome(name="z1_gas1_tmbspg32", stage=1, status=R.PREDICTED_OOM)]
    table = R.format_summary(outcomes, "throughput", [0, 1])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("|")]
    assert rows[0] == ["tuning space", "experiments", "best metric value (throughput)", "best experiment name"]
    assert rows[1] == ["z0", "1", "10", "z0_gas1_tmbspg4"]
    assert rows[2] == ["z1", "2", "12.5", "z1_gas1_tmbspg8"]
    assert rows[3] == ["global", "3", "12.5", "z1_gas1_tmbspg8"]


def test_learning_rate_advice_fills_in_the_numbers():
    config = {"optimizer": {"params": {"lr": 0.001}}}
    assert R.lr_advice(config, 32, 32) is None
    text = R.lr_advice(config, 64, 16)
    assert "lr_new = lr_old * sqrt(B_new / B_old) = 0.001 * sqrt(64 / 16) = 0.002" in text
    assert "sqrt(64 / B_old)" in R.lr_advice(config, 64, None)


# -- cost model and model-based choice ------------------------------------------------------------


def _profile(capacities=(None, None)):
    return ClusterProfile(time_models=[TimeModel(0.01, 0.001), TimeModel(0.01, 0.0025)], activation_base=[1e6, 1e6],
                          activation_per_sample=[1e6, 1e6], capacities=list(capacities), utilization=1.0,
                          num_parameters=1_000_000, param_bytes=4, optimizer_bytes=8, master_bytes=0,
                          optimizer_offloaded=False, devices=["A100", "V100"])


def test_cost_model_predicts_the_slowest_rank_and_memory_per_stage():
    profile = _profile()
    assert profile.heterogeneous
    prediction = profile.predict(1, 2, (12, 4))
    assert prediction.step_seconds == pytest.approx(2 * max(0.01 + 0.012, 0.01 + 0.010))
    assert prediction.throughput == pytest.approx(32 / prediction.step_seconds)
    # Stage 0: params + grads 8 B and Adam 8 B per parameter; stage 3 shards all three, and the fp32
    # copy of its partition that ZeRO 1-3 update (4 B), over 2 ranks.
    assert profile.state_bytes(0) == 16_000_000 and profile.state_bytes(3) == 10_000_000
    assert prediction.memory_bytes[0] == pytest.approx(profile.state_bytes(1) + 1e6 + 12e6)
    # The compute-aware split puts more on the faster rank; memory caps it.
    assert profile.balanced_sizes(1, 1, 16) == (12, 4)  # 22 ms vs 20 ms; (11, 5) would be 21 vs 22.5
    small = _profile(capacities=(12e6 + 16e6, None))  # room for 11 samples at stage 0
    assert small.max_micro_batch(0)[0] == 11
    assert not small.predict(0, 1, (12, 4)).fits and small.predict(0, 1, (11, 5)).fits


def test_the_cost_model_adds_each_stages_communication_at_the_measured_bandwidth():
    # The profiling run (ZeRO-1, gas 1) spent 0.2 s per step in collectives: its gradient all-reduce
    # sends 4 MB per rank and its all-gather 2 MB (1M fp32 parameters over 2 ranks), so 30 MB/s.
    profile = replace(_profile(), collective_seconds=0.2, profile_stage=1, profile_gas=1)
    assert profile.stage_bytes(1, 1) == 6e6 and profile.bytes_per_second == pytest.approx(3e7)
    # ZeRO-3 gathers once (the model is under stage3_max_reuse_distance) and reduce-scatters once per
    # micro-step: 4 MB; ZeRO-2 all-reduces every micro-step.
    assert profile.communication(3, 1) == pytest.approx(4e6 / 3e7)
    assert profile.communication(2, 2) == pytest.approx((2 * 4e6 + 2e6) / 3e7)
    prediction = profile.predict(3, 1, (12, 4))
    assert prediction.step_seconds == pytest.approx(0.022 + 4e6 / 3e7)
    assert prediction.communication_seconds == pytest.approx(4e6 / 3e7)
    # On gloo a reduce-scatter is an all-reduce: ZeRO-3's gradients cost twice the bytes.
    gloo = replace(profile, backend="gloo")
    assert gloo.stage_bytes(3, 1) == profile.stage_bytes(3, 1) + 2e6
    # Without the measurement the prediction is compute alone (a profile written by an older run).
    assert _profile().predict(3, 1, (12, 4)).step_seconds == pytest.approx(0.022)
    assert any("30.0 MB/s" in row or "28.6 MiB/s" in row for row in profile.summary())


class _PredictedSearch(TuningSearch):
    """The search alone: experiments "run" at their predicted metric, and are recorded."""

    def __init__(self, profile, stages, **block):
        config = {"train_batch_size": 16, "zero_optimization": {"stage": stages},
                  "autotuning": {"enabled": True, **block}}
        self.settings = parse_settings(config)
        self.space = parse_space(config, self.settings, 2)
        self.profile, self.outcomes, self.planned, self.ran = profile, [], 0, []

    def _run(self, experiment, predicted=None, settings=None):
        self.ran.append(experiment.name)
        outcome = R.Outcome(name=experiment.name, stage=experiment.stage, status=R.OK, value=predicted)
        self.outcomes.append(outcome)
        return outcome


def _fitting(profile, stages):
    experiments = [Experiment(stage=s, gas=1, micro_batch_sizes=sizes, heterogeneous=True)
                   for s in stages for sizes in ((8, 8), (12, 4))]
    return [(e, profile.predict(e.stage, e.gas, e.micro_batch_sizes)) for e in experiments]


def test_fast_mode_skips_zero3_where_zero2_fits_its_micro_batches():
    profile = replace(_profile(), collective_seconds=0.2, profile_stage=1, profile_gas=1)
    search = _PredictedSearch(profile, [1, 2, 3])
    search._fast(_fitting(profile, [1, 2, 3]))
    pruned = [o for o in search.outcomes if o.status == R.PRUNED]
    assert [o.stage for o in pruned] == [3] and "ZeRO-2 is predicted to fit its micro-batches [12, 4]" in \
        pruned[0].error, pruned
    # ZeRO-3 sends fewer bytes than ZeRO-1/2 (their gradient all-reduce), but bytes do not rank stages.
    assert profile.communication(3, 1) < profile.communication(1, 1)
    assert [name.split("_")[0] for name in search.ran] == ["z1", "z2", "z1"], search.ran
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in R.format_summary(search.outcomes, "throughput", [1, 2, 3]).splitlines() if line.startswith("|")}
    assert (rows["z1"], rows["z2"], rows["z3"], rows["global"]) == ("2", "1", "0", "3"), rows  # pruned: not run
    # Where ZeRO-2 cannot hold those micro-batches ZeRO-3 runs; without ZeRO-2, or with pruning off, too.
    tight = replace(_profile(), capacities=[10e6 + 1e6 + 12e6, None])  # ZeRO-3's state fits 12 samples, ZeRO-2's not
    assert tight.predict(3, 1, (12, 4)).fits and not tight.predict(2, 1, (12, 4)).fits
    for search, stages in ((_PredictedSearch(tight, [2, 3]), [2, 3]), (_PredictedSearch(profile, [1, 3]), [1, 3]),
                           (_PredictedSearch(profile, [1, 2, 3], plan_pruning=False), [1, 2, 3])):
        fitting = [(e, p) for e, p in _fitting(search.profile, stages) if p.fits]
        search._fast(fitting)
        assert any(name.startswith("z3") for name in search.ran), search.ran
        assert not any(o.status == R.PRUNED for o in search.outcomes)
    with pytest.raises(AutotuningConfigError, match="plan_pruning"):
        parse_settings({"autotuning": {"plan_pruning": 0.25}})


def test_model_based_choice_follows_corrected_predictions_and_really_explores():
    """Upstream's exploration branch computed a feature and never used it."""
    profile = _profile()
    todo = [(Experiment(stage=s, gas=1, micro_batch_sizes=(11, 5)), profile.predict(s, 1, (11, 5))) for s in (0, 1, 2)]
    # Stage 2 measured at half its prediction, stage 0 at 90%: the model's choice is stage 0.
    corrections = {0: 0.9, 2: 0.5}
    picks = [choose_next(todo, corrections, "throughput", random.Random(seed)) for seed in range(200)]
    exploit = picks.count(0) / len(picks)
    assert exploit == pytest.approx(1 - EXPLORATION, abs=0.08)
    assert {1, 2} <= set(picks)  # exploration reaches candidates the model ranks lower
    # Latency: smaller is better, so the stage measured at half its predicted time is the choice.
    latency_picks = [choose_next(todo, {0: 1.0, 1: 0.5, 2: 1.0}, "latency", random.Random(seed)) for seed in range(200)]
    assert max(set(latency_picks), key=latency_picks.count) == 1


# -- pipelines: the degree and the partition ---------------------------------------------------------


def _pipeline_config(pipeline=None, world_block=None, **top):
    """A ds_config that tunes a PipelineModule's degree (flag --stages) and partition."""
    block = {"enabled": True, "arg_mappings": {"pipeline.num_stages": "--stages"},
             "pipeline": pipeline if pipeline is not None else {"num_stages": [1, 2],
                                                                "partition": ["balanced", "parameters"]}}
    block.update(world_block or {})
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
              "heterogeneous_config": {"enabled": True}, "autotuning": block}
    config.update(top)
    return config


def _pipeline_space(config, world=2):
    return parse_space(config, parse_settings(config), world)


@pytest.mark.parametrize("change, words", [
    ({"pipeline": [1, 2]}, "autotuning.pipeline = [1, 2]: must be a map"),
    ({"pipeline": {"num_stages": [2], "stages": 2}}, "autotuning.pipeline: unknown key(s) ['stages']; allowed keys: "
     "num_stages, partition"),
    ({"pipeline": {"partition": "balanced"}}, "autotuning.pipeline.num_stages is missing"),
    ({"pipeline": {"num_stages": [0, 2]}}, "autotuning.pipeline.num_stages = [0, 2]: use a positive integer"),
    ({"pipeline": {"num_stages": 2, "partition": ["fast"]}},
     "autotuning.pipeline.partition = ['fast']: use one of 'balanced', 'parameters', 'uniform'"),
    ({"arg_mappings": {}}, "autotuning.arg_mappings has no \"pipeline.num_stages\""),
    ({"pipeline": {"num_stages": [3]}}, "autotuning.pipeline.num_stages = [3]: no degree divides the 2 rank(s)"),
])
def test_a_bad_pipeline_block_is_refused_naming_the_key_and_what_is_allowed(change, words):
    config = _pipeline_config(world_block=change)
    with pytest.raises(AutotuningConfigError) as error:
        _pipeline_space(config)
    assert words in str(error.value)


@pytest.mark.parametrize("change, words", [
    ({"heterogeneous_config": {"enabled": False}}, "autotuning.pipeline needs heterogeneous_config.enabled: true"),
    ({"heterogeneous_config": {"enabled": True, "scheduler": {"dynamic_rebalancing": True}}},
     "dynamic_rebalancing is true, which a PipelineModule refuses"),
    ({"heterogeneous_config": {"enabled": True, "pipeline": {"stage_layers": [4, 2]}}},
     "heterogeneous_config.pipeline.stage_layers is a manual cut"),
    ({"zero_optimization": {"stage": [2, 3]}}, "zero_optimization.stage = [2, 3]: with autotuning.pipeline, ZeRO "
     "stage 0 or 1 only"),
])
def test_a_pipeline_space_the_pipeline_engine_cannot_run_is_refused(change, words):
    with pytest.raises(AutotuningConfigError) as error:
        _pipeline_space(_pipeline_config(**change))
    assert words in str(error.value)


def test_the_pipeline_space_leaves_out_what_cannot_run_with_notes():
    config = _pipeline_config({"num_stages": [4, 1, 3, 2], "partition": ["parameters", "balanced"]},
                              zero_optimization={"stage": "auto"})
    space = _pipeline_space(config, world=4)
    assert space.pipeline.degrees == (1, 2, 4) and space.pipeline.flag == "--stages"
    assert space.pipeline.partitions == ("balanced", "parameters")  # in a fixed order
    assert space.stages == [0, 1]  # "auto": every stage the pipeline engine accepts
    assert space.notes == ["autotuning.pipeline.num_stages [3] left out: a degree must divide the 4 rank(s)",
                           "ZeRO stages [2, 3] left out: DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 "
                           "(any pipeline degree)"]
    # One stage has no cut: one point, not one per partition.
    assert space.pipeline.points() == [(1, None), (2, "balanced"), (2, "parameters"), (4, "balanced"),
                                       (4, "parameters")]
    assert [space.replicas(d) for d in space.pipeline.degrees] == [4, 2, 1]
    single = _pipeline_space(_pipeline_config({"num_stages": 2}))
    assert single.pipeline.partitions == ("balanced", ) and single.notes == []


def test_a_fixed_global_batch_gets_its_accumulation_steps_per_degree():
    """4 ranks, train_batch_size 4: one stage has 4 replicas (gas 1 only), two stages 2 replicas
    (gas 1 or 2), four stages 1 replica (gas 1, 2 or 4)."""
    config = _pipeline_config({"num_stages": [1, 2, 4]}, train_batch_size=4, gradient_accumulation_steps="auto",
                              **{"train_micro_batch_size_per_gpu": [1, 2, 4]})
    space = _pipeline_space(config, world=4)
    assert space.gas_by_degree == {1: [1], 2: [1, 2], 4: [1, 2, 4]}
    # A degree that cannot give the batch is left out, and says why.
    config = _pipeline_config({"num_stages": [1, 2]}, train_batch_size=2, gradient_accumulation_steps=1)
    space = _pipeline_space(config, world=4)
    assert space.pipeline.degrees == (2, ) and space.gas_for(2) == [1]
    assert space.notes[0].startswith("pipeline degree 1 left out (4 replica(s)): train_batch_size 2 is smaller "
                                     "than the 4 data-parallel ranks")


class _Search(TuningSearch):
    """The search's candidate logic over a parsed space, without a tuner."""

    def __init__(self, space, settings):
        self.space, self.settings, self.dp_world, self.profile = space, settings, space.world_size, None


def test_pipeline_candidates_are_degree_partition_stage_and_gas_named_by_them():
    config = _pipeline_config(zero_optimization={"stage": [0, 1]})
    space = _pipeline_space(config)
    names = [e.name for e in _Search(space, parse_settings(config))._candidates()]
    assert names == ["pp1_z0_gas4_tmbspg2", "pp1_z1_gas4_tmbspg2", "pp2bal_z0_gas4_tmbspg4", "pp2bal_z1_gas4_tmbspg4",
                     "pp2par_z0_gas4_tmbspg4", "pp2par_z1_gas4_tmbspg4"]
    # Without a fixed batch: per-replica sizes over each degree's replicas.
    free = _pipeline_config({"num_stages": [1, 2], "partition": "uniform"}, train_batch_size="auto",
                            gradient_accumulation_steps=1, **{"train_micro_batch_size_per_gpu": [2, 4]})
    candidates = _Search(_pipeline_space(free), parse_settings(free))._candidates()
    assert [(e.name, e.micro_batch_sizes, e.train_batch_size) for e in candidates] == [
        ("pp1_z1_gas1_tmbspg2", (2, 2), 4), ("pp1_z1_gas1_tmbspg4", (4, 4), 8),
        ("pp2uni_z1_gas1_tmbspg2", (2, ), 2), ("pp2uni_z1_gas1_tmbspg4", (4, ), 4)]


def test_pipeline_experiment_config_sets_the_partition_and_the_flag_the_degree():
    user = _pipeline_config(heterogeneous_config={"enabled": True, "load_balancing_strategy": "manual",
                                                  "micro_batch_sizes": [3, 1],
                                                  "pipeline": {"layer_cost": "parameters"}})
    settings = parse_settings(user)
    two = Experiment(stage=1, gas=4, micro_batch_sizes=(4, ), heterogeneous=True, pipeline_stages=2,
                     partition="parameters")
    config = two.ds_config(user, "m.json", settings)
    assert two.name == "pp2par_z1_gas4_tmbspg4"
    assert config["heterogeneous_config"]["pipeline"] == {"layer_cost": "parameters", "partition": "parameters"}
    # The replicas' plan is the engine's, from their speeds; nothing the pipeline refuses.
    assert config["heterogeneous_config"]["load_balancing_strategy"] == "compute_aware"
    assert "micro_batch_sizes" not in config["heterogeneous_config"]
    assert config["heterogeneous_config"]["scheduler"]["dynamic_rebalancing"] is False
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (16, 4)
    assert "train_micro_batch_size_per_gpu" not in config and "pipeline" not in config["autotuning"]
    one = Experiment(stage=0, gas=4, micro_batch_sizes=(2, 2), heterogeneous=True, pipeline_stages=1)
    assert one.name == "pp1_z0_gas4_tmbspg2"
    assert "partition" not in one.ds_config(user, "m.json", settings)["heterogeneous_config"]["pipeline"]
    args = ["--deepspeed_config", "ds.json", "--stages", "8"]
    assert experiment_args(args, "e.json", settings.arg_mappings, two)[-2:] == ["--stages", "2"]
    plain = Experiment(stage=1, gas=1, micro_batch_sizes=(2, 2))  # no pipeline tuned: the script's own degree
    assert experiment_args(args, "e.json", settings.arg_mappings, plain)[-2:] == ["--stages", "8"]


def test_a_pipeline_experiment_reports_its_replicas_plan_and_the_summary_its_degree_and_partition():
    metrics = {"ranks": [{"rank": 1, "micro_batch_size": 1}, {"rank": 0, "micro_batch_size": 3}]}
    assert replica_micro_batches(metrics, 2) == [3, 1]  # ranks 0, 1: stage 0 of replicas 0, 1
    assert replica_micro_batches(metrics, 1) == [3]
    outcomes = [R.Outcome("pp1_z1_gas4_tmbspg2", 1, R.OK, 100.0, pipeline_stages=1),
                R.Outcome("pp2bal_z1_gas4_tmbspg4", 1, R.OK, 80.0, pipeline_stages=2, partition="balanced"),
                R.Outcome("pp2par_z1_gas4_tmbspg4", 1, R.FAILED, pipeline_stages=2, partition="parameters")]
    table = R.format_summary(outcomes, "throughput", [1], [(1, None), (2, "balanced"), (2, "parameters")])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    assert rows[1:] == [["z1", "3", "100", "pp1_z1_gas4_tmbspg2"], ["pp1", "1", "100", "pp1_z1_gas4_tmbspg2"],
                        ["pp2 balanced", "1", "80", "pp2bal_z1_gas4_tmbspg4"], ["pp2 parameters", "1", "-", "-"],
                        ["global", "3", "100", "pp1_z1_gas4_tmbspg2"]]


def test_the_tuner_counts_the_ranks_a_launch_with_its_flags_uses():
    """The tuner sizes its experiments by the hosts and slots the launcher keeps for --num_nodes
    and --num_gpus, without importing the launcher (which imports the tuner)."""
    import collections
    from deepspeed.autotuning.heterogeneous.tuner import _resources_in_use
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus
    resources = collections.OrderedDict([("node-a", [0, 1, 2, 3]), ("node-b", [0, 1])])
    for num_nodes in (-1, 1, 2, 3):
        for num_gpus in (-1, 1, 2, 5):
            assert _resources_in_use(resources, num_nodes, num_gpus) == dict(
                apply_num_nodes_and_gpus(resources, num_nodes, num_gpus)), (num_nodes, num_gpus)
