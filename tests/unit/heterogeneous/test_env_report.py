# SPDX-License-Identifier: Apache-2.0
"""``ds_report --heterogeneous``: the four status lines, the device table and config errors."""

import io
import json
import re

import pytest

from deepspeed.runtime.heterogeneous.measure import devices
from deepspeed.runtime.heterogeneous.cli import env_report
from deepspeed.runtime.heterogeneous.measure.devices import DeviceDescription, describe_local_device
from deepspeed.runtime.heterogeneous.cli.env_report import (communication_optimization_active, heterogeneous_report,
                                                            main)

STATUS_PREFIXES = ("Heterogeneous Environment:", "Mixed GPU Support:", "Load Balancing Strategy:",
                   "Communication Optimization:")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DS_HETEROGENEOUS_ENV", "DS_ADAPTIVE_SCHEDULING"):
        monkeypatch.delenv(name, raising=False)


def report_lines(config_path=None):
    output = io.StringIO()
    heterogeneous_report(config_path, file=output)
    return output.getvalue().splitlines()


def status_lines(lines):
    return [line for line in lines if line.startswith(STATUS_PREFIXES)]


def write_config(tmp_path, config):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def cpu_support_line():
    return (f"Mixed GPU Support: none (CPU accelerator: {describe_local_device().name}; "
            "heterogeneous_config.emulation emulates a mixed cluster on it)")


def test_without_config_or_environment_it_is_disabled():
    assert status_lines(report_lines()) == [
        "Heterogeneous Environment: Disabled",
        cpu_support_line(),
        "Load Balancing Strategy: Uniform",
        "Communication Optimization: Inactive",
    ]


def test_disabled_says_how_to_enable_it(tmp_path):
    without = report_lines()
    hint = without[without.index("Heterogeneous Environment: Disabled") + 1]
    assert hint.startswith("note: heterogeneous training is off"), hint
    assert "no config given and DS_HETEROGENEOUS_ENV is unset" in hint and "--config" in hint, hint
    assert "DS_HETEROGENEOUS_ENV=1" in hint and '"heterogeneous_config": {"enabled": true}' in hint, hint
    with_config = report_lines(write_config(tmp_path, {"train_batch_size": 8}))
    hint = with_config[with_config.index("Heterogeneous Environment: Disabled") + 1]
    assert 'the config has no "heterogeneous_config": {"enabled": true}' in hint, hint


def test_environment_variable_enables_compute_aware_defaults(monkeypatch):
    monkeypatch.setenv("DS_HETEROGENEOUS_ENV", "1")
    assert status_lines(report_lines()) == [
        "Heterogeneous Environment: Enabled",
        cpu_support_line(),
        "Load Balancing Strategy: Compute-Aware",
        "Communication Optimization: Inactive",
    ]


def test_config_enabling_compute_aware_shows_options_and_emulated_capacities(tmp_path):
    config_path = write_config(tmp_path, {
        "train_batch_size": 16,
        "heterogeneous_config": {
            "enabled": True,
            "load_balancing_strategy": "compute_aware",
            "profile_steps": 4,
            "scheduler": {"dynamic_rebalancing": True, "imbalance_threshold": 0.2, "check_interval": 10},
            "emulation": {"speeds": [1.0, 0.5], "memory_gb": [16, 8], "mode": "dilation"},
        },
        "heterogeneous_memory": {"enabled": True, "cpu_memory_limit": "4GB"},
        "zero_optimization": {"stage": 2, "heterogeneous_offload": {"cpu_offload": True}},
    })
    lines = report_lines(config_path)
    assert status_lines(lines) == [
        "Heterogeneous Environment: Enabled",
        cpu_support_line(),
        "Load Balancing Strategy: Compute-Aware",
        "Communication Optimization: Inactive",
    ]
    table_rows = [line for line in lines if "(emulated)" in line]
    assert len(table_rows) == 2
    assert "16.0 (emulated)" in table_rows[0] and "8.0 (emulated)" in table_rows[1]
    text = "\n".join(lines)
    assert "profile_steps: 4" in text
    assert "dynamic_rebalancing=True, imbalance_threshold=0.2, check_interval=10" in text
    assert "speeds=[1.0, 0.5]" in text and "mode=dilation" in text
    assert "cpu_memory_limit=4GB" in text
    assert "heterogeneous_offload: cpu_offload=True" in text


def test_measured_score_says_how_noisy_it_was():
    row = next(line for line in report_lines() if line.startswith("0 "))
    assert re.search(r"  measured \(median of 5, spread ±[0-9]+%\)$", row), row


def test_config_without_a_fork_block_lists_no_defaults(tmp_path):
    lines = report_lines(write_config(tmp_path, {"train_batch_size": 8, "fp16": {"enabled": True}}))
    assert "Options selected by the config: none (no heterogeneous block: upstream behaviour)" in lines
    assert not [line for line in lines if line.startswith("  ")]


def test_only_the_blocks_a_config_gives_are_listed(tmp_path):
    lines = report_lines(write_config(tmp_path, {"heterogeneous_memory": {"cpu_memory_limit": "4GB"}}))
    start = lines.index("Options selected by the config:")
    assert [line.split(":")[0] for line in lines[start + 1:] if line.startswith("  ")] == ["  heterogeneous_memory"]


def test_misspelled_block_is_noted_in_the_report(tmp_path):
    lines = report_lines(write_config(tmp_path, {"heterogenous_config": {"enabled": True}}))
    assert "Heterogeneous Environment: Disabled" in lines
    assert any(line.startswith("note: unknown top-level key 'heterogenous_config'") and
               "did you mean 'heterogeneous_config'?" in line for line in lines)


def test_emulated_speed_scales_the_score(tmp_path):
    config_path = write_config(tmp_path, {
        "heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 0.25]}},
    })
    rows = env_report._device_rows(env_report.load_heterogeneous_settings(env_report.read_config_file(config_path)))
    (fast, _, _), (slow, memory_emulated, speed_emulated) = rows
    assert slow.spec_score == pytest.approx(fast.spec_score * 0.25)
    assert (memory_emulated, speed_emulated) == (False, True)


@pytest.mark.parametrize("block, strategy_line", [
    ({"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": [4, 2]},
     "Load Balancing Strategy: Manual"),
    ({"enabled": True, "load_balancing_strategy": "uniform"}, "Load Balancing Strategy: Uniform"),
    # A disabled block is upstream behaviour, whatever strategy it names.
    ({"enabled": False, "load_balancing_strategy": "compute_aware"}, "Load Balancing Strategy: Uniform"),
])
def test_strategy_line_follows_the_config(tmp_path, block, strategy_line):
    lines = report_lines(write_config(tmp_path, {"heterogeneous_config": block}))
    assert strategy_line in lines
    expected_state = "Enabled" if block["enabled"] else "Disabled"
    assert f"Heterogeneous Environment: {expected_state}" in lines


class _FakeThreeGpuAccelerator:

    def device_name(self, device_index=None):
        return "cuda"

    def device_count(self):
        return 3


def test_mixed_gpus_are_listed_once_each(monkeypatch):
    names = ["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB"]
    scores = [312.0, 125.0, 312.0]

    def describe(local_rank=0, memory_bytes=None, rank=None):
        return DeviceDescription(rank=rank, local_rank=local_rank, host="node-a", name=names[local_rank],
                                 memory_bytes=32 * 2**30, bf16=local_rank != 1, fp16=True, accelerator="cuda",
                                 spec_score=scores[local_rank], score_source="spec")

    monkeypatch.setattr(env_report, "get_accelerator", _FakeThreeGpuAccelerator)
    monkeypatch.setattr(devices, "get_accelerator", _FakeThreeGpuAccelerator)
    monkeypatch.setattr(env_report, "describe_local_device", describe)
    lines = report_lines()
    assert "Mixed GPU Support: NVIDIA A100-SXM4-80GB, Tesla V100-SXM2-32GB" in lines
    table_rows = [line for line in lines if line.endswith("spec")]
    assert [row.split()[0] for row in table_rows] == ["0", "1", "2"]
    assert "Tesla V100-SXM2-32GB" in table_rows[1] and "125" in table_rows[1]


@pytest.mark.parametrize("config, expected", [
    ({"fp16": {"enabled": True}}, ["Training Precision: fp16 (the config's fp16/bf16 blocks)"]),
    ({"bfloat16": {"enabled": True}, "heterogeneous_config": {"enabled": True}},
     ["Training Precision: bf16 (the config's fp16/bf16 blocks)"]),
    ({"bf16": {"enabled": True}, "heterogeneous_config": {"enabled": True, "mixed_precision_support": "fp32"}},
     ["Training Precision: fp32 (forced by mixed_precision_support 'fp32')",
      "note: the config's bf16 block (bf16) is overridden: heterogeneous_config.mixed_precision_support 'fp32' wins "
      "(forced by mixed_precision_support 'fp32')"]),
])
def test_precision_line_is_the_runtime_choice(tmp_path, config, expected):
    lines = report_lines(write_config(tmp_path, config))
    start = next(index for index, line in enumerate(lines) if line.startswith("Training Precision:"))
    assert lines[start:start + len(expected)] == expected


def test_communication_optimization_needs_ranks_on_several_hosts():
    """From a config alone (one host here) it is Inactive; on two hosts it is Active (the parts are
    tested in test_communication_status.py)."""
    from deepspeed.runtime.heterogeneous.cluster.topology import Topology
    settings = env_report.load_heterogeneous_settings({"heterogeneous_config": {"enabled": True}})
    assert communication_optimization_active(settings) is False
    assert communication_optimization_active(settings, Topology((0, 0, 1, 1), (None, 2.5e7))) is True


def test_main_succeeds_on_a_good_config(tmp_path, capsys):
    config_path = write_config(tmp_path, {"heterogeneous_config": {"enabled": True}})
    assert main(["--config", config_path]) == 0
    assert "Heterogeneous Environment: Enabled" in capsys.readouterr().out


@pytest.mark.parametrize("contents, named", [
    (json.dumps({"heterogeneous_config": {"enabled": True, "load_balancing_stratgy": "manual"}}),
     "load_balancing_stratgy"),
    (json.dumps({"heterogeneous_config": {"enabled": True, "scheduler": {"imbalance_threshold": 3}}}),
     "imbalance_threshold"),
    (json.dumps({"heterogeneous_memory": {"cpu_memory_limit": "lots"}}), "cpu_memory_limit"),
    ("{\"heterogeneous_config\": {", "not valid JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_config_exits_2_with_one_line_naming_the_problem(tmp_path, capsys, contents, named):
    path = tmp_path / "ds_config.json"
    path.write_text(contents)
    assert main(["--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    error_lines = captured.err.strip().splitlines()
    assert len(error_lines) == 1 and named in error_lines[0]
    assert "Traceback" not in captured.err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_bad_environment_value_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("DS_HETEROGENEOUS_ENV", "maybe")
    assert main([]) == 2
    assert "DS_HETEROGENEOUS_ENV" in capsys.readouterr().err


PIPELINE_CONFIG = {
    "train_batch_size": 16,
    "heterogeneous_config": {"enabled": True, "emulation": {"speeds": [1.0, 1.0, 0.5, 0.5],
                                                            "memory_gb": [16, 16, 8, 8], "mode": "dilation"}},
}


def test_pipeline_stages_show_stage_speeds_and_replicas(tmp_path):
    """Run as a user runs it (``ds_report --heterogeneous``, upstream's entry point passing the flag
    on): global ranks 0, 1 are stage 0's replicas, 2, 3 stage 1's (upstream's
    PipeDataParallelTopology); a stage runs at its slowest replica's speed."""
    import os
    import subprocess
    import sys
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ds_report"), "--heterogeneous", "--config",
                           write_config(tmp_path, PIPELINE_CONFIG), "--pipeline-stages", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    section = lines[next(i for i, line in enumerate(lines) if line.startswith("Pipeline:")):]
    assert section[0].startswith("Pipeline: 2 stage(s) x 2 replica(s) = 4 processes "
                                 "(one per heterogeneous_config.emulation.speeds entry)"), section[0]
    stage_rows = [line.split() for line in section if re.match(r"  [01]  ", line)]
    assert [" ".join(row) for row in stage_rows] == ["0 0 (1, 16 GiB), 1 (1, 16 GiB) 1 13.6",
                                                     "1 2 (0.5, 8 GiB), 3 (0.5, 8 GiB) 0.5 6.8"]
    assert "Stage Speeds: [1.0, 0.5]" in section
    assert any(line.startswith("Replica Speeds: [1.0, 1.0]") for line in section), section
    assert "  replica 0: global ranks 0, 2 (stage order), relative pipeline speed 1" in section
    assert "  replica 1: global ranks 1, 3 (stage order), relative pipeline speed 1" in section
    layers = next(line for line in section if line.startswith("Layers per stage:"))
    assert "measured" in layers and "start-up table" in layers, layers


def test_pipeline_replica_speed_and_stage_layers(tmp_path, capsys):
    """A replica whose every stage is faster than the stage's slowest copy is the faster pipeline;
    the layers per stage are shown when the config gives them."""
    config = {"heterogeneous_config": {"enabled": True, "pipeline": {"stage_layers": [5, 3]},
                                       "emulation": {"speeds": [1.0, 0.5, 1.0, 0.5]}}}
    assert main(["--config", write_config(tmp_path, config), "--pipeline-stages", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Stage Speeds: [0.5, 0.5]" in lines
    assert any(line.startswith("Replica Speeds: [1.0, 0.5]") for line in lines), lines
    assert "Layers per stage: [5, 3] (heterogeneous_config.pipeline.stage_layers)" in lines
    assert any(re.match(r"  0\s+0 \(1\), 1 \(0\.5\)\s+0\.5\s+none$", line) for line in lines), lines


def test_pipeline_world_size_flag_without_emulation(capsys):
    """Without emulation lists the processes come from --world-size; every rank runs this host's device."""
    assert main(["--pipeline-stages", "2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline: 2 stage(s) x 2 replica(s) = 4 processes (--world-size)" in out
    assert "Stage Speeds: [1.0, 1.0]" in out


@pytest.mark.parametrize("arguments, config_change, named", [
    (["--pipeline-stages", "3"], {}, "--pipeline-stages 3 does not divide the job's 4 process(es)"),
    (["--pipeline-stages", "3"], {}, "allowed: 1, 2, 4"),
    (["--pipeline-stages", "0"], {}, "--pipeline-stages '0' is not allowed"),
    (["--pipeline-stages", "two"], {}, "an integer >= 1"),
    (["--pipeline-stages", "2", "--world-size", "8"], {}, "heterogeneous_config.emulation.speeds has 4 entries"),
    (["--world-size", "4"], {}, "--world-size is only used with --pipeline-stages"),
    (["--pipeline-stages", "2"], {"pipeline": {"stage_layers": [1, 2, 3]}}, "pipeline.stage_layers [1, 2, 3]"),
    (["--pipeline-stages", "2"], {"emulation": {"speeds": [1.0, 0.5], "memory_gb": [8, 8, 8, 8]}},
     "emulation.speeds has 2 entries and emulation.memory_gb 4"),
])
def test_bad_pipeline_arguments_exit_2_naming_the_flag_or_key(tmp_path, capsys, arguments, config_change, named):
    config = json.loads(json.dumps(PIPELINE_CONFIG))
    config["heterogeneous_config"].update(config_change)
    assert main(["--config", write_config(tmp_path, config)] + arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    error_lines = captured.err.strip().splitlines()
    assert len(error_lines) == 1 and named in error_lines[0], captured.err


def test_pipeline_stages_beyond_this_hosts_devices_ask_for_the_world_size(capsys):
    assert main(["--pipeline-stages", str(devices.local_device_count() + 1)]) == 2
    assert "give --world-size" in capsys.readouterr().err


def test_rank_speeds_are_the_runtimes():
    """The report and the pipeline's start-up share one formula: the spec score relative to the
    fastest times the emulated speed; a device the table does not know (score 0) counts as 1."""
    from deepspeed.runtime.heterogeneous.cli import pipeline_report
    from deepspeed.runtime.heterogeneous.planning.stages import relative_rank_speeds
    assert pipeline_report.relative_rank_speeds is relative_rank_speeds
    assert relative_rank_speeds([312.0, 156.0], [1.0, 0.5]) == [1.0, 0.25]
    assert relative_rank_speeds([0.0, 0.0], [1.0, 0.5]) == [1.0, 0.5]
