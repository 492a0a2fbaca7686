# SPDX-License-Identifier: Apache-2.0
"""The fork's configuration blocks: parsing, errors, environment variables, the scheduler alias,
and what deepspeed.initialize makes of them on two real ranks."""

import os

import pytest
import torch

from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings, parse_bytes

from harness import run_subcases


def parse(config, world_size=None, **environ):
    return load_heterogeneous_settings(dict(config), world_size=world_size, environ=environ)


def error_of(config, world_size=None, **environ):
    with pytest.raises(ValueError) as info:
        parse(config, world_size=world_size, **environ)
    return str(info.value)


def test_defaults_are_off_and_match_design():
    settings = parse({})
    assert not settings.enabled
    assert settings.config.load_balancing_strategy == "compute_aware"
    assert settings.config.profile_steps == 5  # 3: too few to tell noise from fixed cost (bench_profiling_gate.py)
    assert settings.config.scheduler.imbalance_threshold == 0.1
    assert settings.config.scheduler.check_interval == 20
    assert not settings.config.scheduler.dynamic_rebalancing
    assert settings.config.emulation is None
    assert settings.memory.hbm_utilization_threshold == 0.85 and settings.memory.adaptive_chunking
    assert not settings.offload.cpu_offload and not settings.offload.nvme_offload
    assert settings.notes == []


def test_design_example_parses():
    config = {
        "train_batch_size": 256,
        "heterogeneous_config": {
            "enabled": True, "load_balancing_strategy": "compute_aware", "mixed_precision_support": "adaptive",
            "micro_batch_sizes": None, "profile_steps": 3,
            "scheduler": {"type": "compute_aware", "dynamic_rebalancing": True, "imbalance_threshold": 0.1,
                          "check_interval": 20},
            "emulation": {"speeds": [1.0, 0.4], "memory_gb": [16, 8], "mode": "cgroup"}},
        "heterogeneous_memory": {"enabled": True, "adaptive_chunking": True, "hbm_utilization_threshold": 0.85,
                                 "cpu_memory_limit": "64GB"},
        "zero_optimization": {"stage": 3, "heterogeneous_offload": {"cpu_offload": True, "nvme_offload": False}},
    }
    settings = parse(config, world_size=2)
    assert settings.enabled and settings.config.mixed_precision_support == "adaptive"
    assert settings.config.emulation.speeds == [1.0, 0.4] and settings.config.emulation.mode == "cgroup"
    assert settings.memory.cpu_memory_limit_bytes == 64 * 10**9
    assert settings.offload.cpu_offload


@pytest.mark.parametrize("config, expected", [
    ({"heterogeneous_config": {"enabled": True, "profile_step": 3}},
     "heterogeneous_config.profile_step: unknown key 'profile_step'; did you mean 'profile_steps'? allowed keys: check_fed_batch, communication, "
     "elastic, emulation, enabled"),
    ({"heterogeneous_config": {"scheduler": {"interval": 5}}},
     "heterogeneous_config.scheduler.interval: unknown key 'interval'; did you mean 'check_interval'? allowed keys: check_interval"),
    ({"heterogeneous_config": {"emulation": {"speed": [1]}}},
     "heterogeneous_config.emulation.speed: unknown key 'speed'; did you mean 'speeds'? allowed keys: dilation_clock, memory_gb, mode, speed_schedule, speeds"),
    ({"heterogeneous_memory": {"hbm_threshold": 0.5}},
     "heterogeneous_memory.hbm_threshold: unknown key 'hbm_threshold'; allowed keys: activation_bytes_per_sample, "
     "adaptive_chunking"),
    ({"zero_optimization": {"heterogeneous_offload": {"gpu_offload": True}}},
     "zero_optimization.heterogeneous_offload.gpu_offload: unknown key 'gpu_offload'; did you mean 'cpu_offload'? allowed keys: cpu_offload"),
])
def test_unknown_keys_are_named_with_the_allowed_ones(config, expected):
    assert expected in error_of(config)


@pytest.mark.parametrize("config, expected", [
    ({"heterogeneous_config": {"load_balancing_strategy": "fastest"}},
     "heterogeneous_config.load_balancing_strategy: 'fastest' is not a registered load-balancing strategy; "
     "registered: 'compute_aware', 'manual', 'uniform'"),
    ({"heterogeneous_config": {"load_balancing_strategy": 3}},
     "heterogeneous_config.load_balancing_strategy: 3 is not a registered load-balancing strategy"),
    ({"heterogeneous_config": {"mixed_precision_support": "int8"}}, "'config', 'adaptive', 'bf16', 'fp16' or 'fp32'"),
    ({"heterogeneous_config": {"profile_steps": -1}}, "heterogeneous_config.profile_steps"),
    ({"heterogeneous_config": {"scheduler": {"imbalance_threshold": 1.5}}},
     "heterogeneous_config.scheduler.imbalance_threshold: Input should be less than 1"),
    ({"heterogeneous_config": {"scheduler": {"check_interval": 0}}}, "scheduler.check_interval"),
    ({"heterogeneous_config": {"emulation": {"speeds": [1.0, 1.5]}}},
     "heterogeneous_config.emulation.speeds[1]: 1.5 is not in (0, 1]"),
    ({"heterogeneous_config": {"emulation": {"speed_schedule": [{"step": 5, "speeds": [0.0, 1.0]}]}}},
     "heterogeneous_config.emulation.speed_schedule[0].speeds[0]: 0.0 is not in (0, 1]"),
    ({"heterogeneous_config": {"emulation": {"mode": "docker"}}}, "'auto', 'cgroup' or 'dilation'"),
    ({"heterogeneous_config": {"load_balancing_strategy": "manual"}}, "'manual' needs micro_batch_sizes"),
    ({"heterogeneous_config": {"micro_batch_sizes": [4, 4]}}, "set the strategy to 'manual' or remove the sizes"),
    ({"heterogeneous_config": {"load_balancing_strategy": "manual", "micro_batch_sizes": [4, 0]}},
     "heterogeneous_config.micro_batch_sizes[1]: Input should be greater than 0"),
    ({"heterogeneous_config": {"load_balancing_strategy": "manual", "micro_batch_sizes": {"A100": -2}}},
     "heterogeneous_config.micro_batch_sizes.A100: Input should be greater than 0"),
    ({"heterogeneous_config": {"load_balancing_strategy": "uniform", "scheduler": {"type": "compute_aware"}}},
     "scheduler.type 'compute_aware' contradicts load_balancing_strategy 'uniform'"),
    ({"heterogeneous_config": {"load_balancing_strategy": "uniform", "scheduler": {"dynamic_rebalancing": True}}},
     "dynamic_rebalancing needs a load_balancing_strategy that adapts to measured speeds ('compute_aware'; got "
     "'uniform')"),
    ({"heterogeneous_memory": {"cpu_memory_limit": "lots"}}, "heterogeneous_memory.cpu_memory_limit: 'lots' is not"),
    ({"zero_optimization": {"heterogeneous_offload": {"nvme_offload": True}}}, "nvme_offload needs nvme_path"),
    ({"heterogeneous_config": [1, 2]}, "heterogeneous_config must be a JSON object"),
    # A value of the wrong type: the message also says what the key takes, range included.
    ({"heterogeneous_config": {"profile_steps": "five"}},
     "heterogeneous_config.profile_steps: Input should be a valid integer, unable to parse string as an integer "
     "(got 'five'); allowed: an integer >= 0"),
    ({"heterogeneous_config": {"emulation": {"speeds": [1.0, "slow"]}}}, "(got 'slow'); allowed: a number in (0, 1]"),
    ({"heterogeneous_config": {"scheduler": {"imbalance_threshold": "high"}}}, "allowed: a number in (0, 1)"),
    ({"heterogeneous_config": {"scheduler": {"check_interval": 2.5}}}, "(got 2.5); allowed: an integer > 0"),
    ({"heterogeneous_config": {"enabled": "maybe"}}, "(got 'maybe'); allowed: true or false"),
    ({"heterogeneous_memory": {"hbm_utilization_threshold": "most"}}, "allowed: a number in (0, 1]"),
])
def test_bad_values_say_what_is_allowed(config, expected):
    assert expected in error_of(config)


def test_per_rank_lists_must_match_the_world():
    config = {"heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.5, 0.2]}}}
    assert "emulation.speeds has 3 entries but the data-parallel world has 2 ranks" in error_of(config, world_size=2)
    manual = {"heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": [4, 4, 4]}}
    assert "micro_batch_sizes has 3 entries" in error_of(manual, world_size=4)
    assert parse(manual, world_size=3).config.micro_batch_sizes == [4, 4, 4]


def test_scheduler_type_alone_sets_the_strategy():
    settings = parse({"heterogeneous_config": {"enabled": True, "scheduler": {"type": "uniform"}}})
    assert settings.config.load_balancing_strategy == "uniform"


def test_seed_style_top_level_scheduler_is_an_alias_and_leaves_lr_schedulers_alone():
    config = {"scheduler": {"type": "compute_aware", "dynamic_rebalancing": True, "check_interval": 7},
              "heterogeneous_config": {"enabled": True}}
    settings = load_heterogeneous_settings(config, environ={})
    assert "scheduler" not in config, "the alias must not reach the LR-scheduler code"
    assert settings.config.scheduler.dynamic_rebalancing and settings.config.scheduler.check_interval == 7
    assert any("move it there" in note for note in settings.notes)

    lr = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    settings = load_heterogeneous_settings(lr, environ={})
    assert lr["scheduler"]["type"] == "WarmupLR" and settings.notes == []

    both = {"scheduler": {"type": "compute_aware"}, "heterogeneous_config": {"scheduler": {}}}
    assert "keep only heterogeneous_config.scheduler" in error_of(both)


def test_environment_variables():
    settings = parse({}, DS_HETEROGENEOUS_ENV="1", DS_ADAPTIVE_SCHEDULING="true")
    assert settings.enabled and settings.config.scheduler.dynamic_rebalancing
    assert len(settings.notes) == 2

    explicit = parse({"heterogeneous_config": {"enabled": False}}, DS_HETEROGENEOUS_ENV="yes")
    assert not explicit.enabled and "block wins" in explicit.notes[0]

    assert not parse({}, DS_HETEROGENEOUS_ENV="0").enabled
    ignored = parse({}, DS_ADAPTIVE_SCHEDULING="on")
    assert not ignored.config.scheduler.dynamic_rebalancing and "ignored" in ignored.notes[0]

    assert "DS_HETEROGENEOUS_ENV='maybe': use one of 1/true/yes/on or 0/false/no/off" in error_of(
        {}, DS_HETEROGENEOUS_ENV="maybe")
    assert "DS_ADAPTIVE_SCHEDULING='2'" in error_of({}, DS_ADAPTIVE_SCHEDULING="2")


@pytest.mark.parametrize("key, suggestion", [
    ("heterogenous_config", "did you mean 'heterogeneous_config'?"),
    ("heterogeneous-config", "did you mean 'heterogeneous_config'?"),
    ("Heterogeneous_Config", "did you mean 'heterogeneous_config'?"),
    ("heterogeneous_memmory", "did you mean 'heterogeneous_memory'?"),
    ("heterogeneous_offload", "it belongs in zero_optimization ('zero_optimization.heterogeneous_offload')"),
])
def test_misspelled_block_is_noted_with_a_suggestion(key, suggestion):
    settings = parse({"train_batch_size": 8, key: {"enabled": True}})
    assert not settings.enabled  # still ignored, as upstream ignores unknown keys, but not silently
    assert len(settings.notes) == 1
    assert f"'{key}' is ignored" in settings.notes[0] and suggestion in settings.notes[0]


@pytest.mark.parametrize("config", [
    {"heterogeneous_config": {"enabled": True}, "heterogeneous_memory": {}},  # the right names
    {"train_batch_size": 8, "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}},  # upstream keys
    {"heterogeneous": {}, "my_experiment": {}, "hetero": 1},  # unknown but not near a fork block
])
def test_no_note_for_known_or_unrelated_keys(config):
    assert parse(config).notes == []


def test_settings_summary_and_mismatch_name_what_differs():
    """What the ranks compare at start-up (agreement.check_settings_agree): every parsed key path and
    the raw environment switches; the message names each difference and which ranks hold what."""
    from deepspeed.runtime.heterogeneous.cluster.agreement import settings_mismatch
    from deepspeed.runtime.heterogeneous.config.settings import ENV_SWITCHES, settings_summary

    block = {"heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.5, 0.5]}}}
    plain = settings_summary(parse(block), environ={})
    assert set(plain["env"]) == set(ENV_SWITCHES) and not any(plain["env"].values())
    assert plain["settings"]["heterogeneous_config.emulation.speeds"] == [1.0, 0.5, 0.5]
    assert plain["settings"]["heterogeneous_memory.hbm_utilization_threshold"] == 0.85
    assert plain["settings"]["zero_optimization.heterogeneous_offload.cpu_offload"] is False
    adaptive = settings_summary(parse(block, DS_ADAPTIVE_SCHEDULING="yes"), environ={"DS_ADAPTIVE_SCHEDULING": "yes"})
    assert settings_mismatch([plain, plain, plain]) is None
    message = settings_mismatch([plain, adaptive, plain])
    assert "DS_ADAPTIVE_SCHEDULING is unset on ranks [0, 2] and 'yes' on ranks [1]" in message
    assert "heterogeneous_config.scheduler.dynamic_rebalancing is false on ranks [0, 2] and true on ranks [1]" \
        in message
    assert "srun and torchrun do not forward them" in message and "same ds_config" in message
    threshold = settings_summary(parse({**block, "heterogeneous_memory": {"hbm_utilization_threshold": 0.5}}),
                                 environ={})
    message = settings_mismatch([plain] * 9 + [threshold])
    assert "hbm_utilization_threshold is 0.85 on ranks [0, 1, 2, 3, 4, 5, ..., 8] (9 ranks) and 0.5 on ranks [9]" \
        in message
    assert "DS_" not in message


def test_parse_bytes():
    assert parse_bytes("64GB") == 64 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes(1024) == 1024
    for bad in ("64XB", "-1GB", True, -5, "GB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# ---------------------------------------------------------------------------------------------
# Through deepspeed.initialize on two ranks: the blocks reach the engine, the alias and the
# environment variables behave, and a typo stops initialize with the key named.


def _initialize_case(rank, world_size, config, environ, expect):
    import deepspeed

    os.environ.update(environ)
    try:
        model = torch.nn.Linear(8, 8)
        base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        try:
            engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config={**base, **config})
        except ValueError as exc:
            assert expect.get("error") and expect["error"] in str(exc), str(exc)
            return "error"
        assert "error" not in expect, "initialize accepted a bad config"
        settings = engine._config.heterogeneous.settings
        assert settings.enabled == expect["enabled"]
        assert settings.config.scheduler.dynamic_rebalancing == expect.get("dynamic", False)
        assert type(scheduler).__name__ == expect.get("lr_scheduler", "NoneType")
        loss = engine(torch.ones(2, 8)).sum()
        engine.backward(loss)
        engine.step()
        return settings.config.load_balancing_strategy
    finally:
        for key in environ:
            os.environ.pop(key, None)


@pytest.mark.multiprocess
def test_blocks_reach_the_engine_on_two_ranks():
    cases = [
        dict(config={"heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform"}},
             environ={}, expect={"enabled": True}),
        dict(config={"scheduler": {"type": "compute_aware", "dynamic_rebalancing": True},
                     "heterogeneous_config": {"enabled": True}},
             environ={}, expect={"enabled": True, "dynamic": True}),
        dict(config={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}},
             environ={}, expect={"enabled": False, "lr_scheduler": "WarmupLR"}),
        dict(config={}, environ={"DS_HETEROGENEOUS_ENV": "1", "DS_ADAPTIVE_SCHEDULING": "true"},
             expect={"enabled": True, "dynamic": True}),
        dict(config={"heterogeneous_config": {"enabled": True, "profile_step": 3}}, environ={},
             expect={"error": "heterogeneous_config.profile_step: unknown key"}),
        dict(config={"heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0]}}}, environ={},
             expect={"error": "emulation.speeds has 1 entries but the data-parallel world has 2 ranks"}),
    ]
    results = run_subcases(_initialize_case, cases, world_size=2, timeout=240)
    assert [r[0] for r in results] == ["uniform", "compute_aware", "compute_aware", "compute_aware", "error", "error"]


BAD_DICT_CONFIG_SCRIPT = """
import torch
import deepspeed
model = torch.nn.Linear(4, 4)
deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "heterogeneous_config": {"enabled": True, "profile_step": 3}})
raise SystemExit("must not run")
"""


@pytest.mark.multiprocess
def test_a_dict_config_error_is_one_line_from_rank_0(tmp_path):
    """Every rank raises the same error: the job prints it once, without a traceback per rank."""
    from harness import launch_deepspeed
    script = tmp_path / "bad_dict_config.py"
    script.write_text(BAD_DICT_CONFIG_SCRIPT)
    code, output = launch_deepspeed(script, num_ranks=2, timeout=240, cwd=tmp_path)
    assert code != 0, output
    lines = [line for line in output.splitlines() if "invalid DeepSpeed config" in line]
    assert len(lines) == 1 and lines[0].startswith("deepspeed: invalid DeepSpeed config: heterogeneous_config."
                                                   "profile_step: unknown key 'profile_step'; did you mean"), output
    assert "Traceback" not in output and "must not run" not in output, output[-3000:]


CONFIG_FILE_SCRIPT = """
import argparse
import torch
import deepspeed
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
deepspeed.add_config_arguments(parser)
args = parser.parse_args()
model = torch.nn.Linear(4, 4)
deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
raise SystemExit("must not run")
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("text, message", [
    ('{"train_batch_size": 8, "heterogeneous_config": {"enabled": true, "emulation": {"speeds": [1.0, 0.5, 0.5]}}}',
     "deepspeed: invalid DeepSpeed config: heterogeneous_config.emulation.speeds has 3 entries but the data-parallel "
     "world has 2 ranks; give one entry per rank"),
    ('{"train_batch_size": 8,\n  "fp16": {"enabled": true}}\n  "optimizer": {}}\n',
     "deepspeed: config {path} is not valid JSON: Extra data: line 3 column 3"),
], ids=["emulation-speeds-length", "json-syntax"])
def test_a_config_file_error_the_ranks_find_is_one_line_from_rank_0(tmp_path, text, message):
    """Errors the launch cannot see in the file (the world size; a file that does not parse, left to
    the ranks) stop every rank at once with one line from rank 0, without a traceback per rank."""
    from harness import launch_deepspeed
    script, config = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(CONFIG_FILE_SCRIPT)
    config.write_text(text)
    # The timeout only guards against a hang (no wall-clock bound in a unit test): such a job ends
    # in 11-16 s on a 2-core machine, under the 30 s the issue asks for.
    code, output = launch_deepspeed(script, ["--deepspeed_config", config], num_ranks=2, timeout=120, cwd=tmp_path)
    assert code != 0, output
    assert output.count(message.format(path=config)) == 1, output[-3000:]
    assert "Traceback" not in output and "must not run" not in output, output[-3000:]


MISFED_SCRIPT = """
import argparse, os, torch, deepspeed
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.parse_args()
model = torch.nn.Linear(8, 8)
config = {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
          "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                   "micro_batch_sizes": [12, 4], "resplit_fed_batches": False}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = int(os.environ["RANK"])
for step in range(3):
    rows = [12, 4][rank] + (1 if rank == 1 and step == 1 else 0)
    engine.backward(engine(torch.randn(rows, 8)).pow(2).mean())
    engine.step()
raise SystemExit("must not run")
"""


@pytest.mark.multiprocess
def test_a_rank_fed_the_wrong_size_ends_the_job_with_one_line(tmp_path):
    """Rank 1 alone is fed 5 rows where the plan gives it 4, with re-splitting off, in ZeRO-2 (a
    gradient collective every micro-step): every rank stops at that forward, and the job ends with
    the message once, from rank 0, without a traceback (before, rank 1 stopped alone and rank 0
    failed in the gradient all-reduce with a second traceback)."""
    from harness import launch_deepspeed
    script = tmp_path / "train.py"
    script.write_text(MISFED_SCRIPT)
    code, output = launch_deepspeed(script, [], num_ranks=2, timeout=120, cwd=tmp_path)
    assert code != 0, output
    message = ("FedBatchMismatchError: deepspeed-hetero: data-parallel rank 1 was fed a micro-batch of 5 samples, "
               "but the plan in force gives it 4")
    assert output.count(message) == 1, output[-3000:]
    assert "Traceback" not in output and "must not run" not in output, output[-3000:]
