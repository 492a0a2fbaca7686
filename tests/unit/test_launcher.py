# SPDX-License-Identifier: Apache-2.0
"""The real `deepspeed` and `ds_report` commands: subcommand, flags, environment forwarding."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
FOUR_LINES = ("Heterogeneous Environment: ", "Mixed GPU Support: ", "Load Balancing Strategy: ",
              "Communication Optimization: ")


def run(args, env=None, cwd=None, timeout=240):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_HETEROGENEOUS", "DS_ADAPTIVE"))}
    full_env.update(env or {})
    proc = subprocess.run(args, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def report_lines(stdout):
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in stdout.splitlines()
            if line.startswith(FOUR_LINES)}


def test_deepspeed_env_report_heterogeneous(tmp_path):
    code, out, err = run([str(BIN / "deepspeed"), "env_report", "--heterogeneous"], cwd=tmp_path)
    assert code == 0, err
    lines = report_lines(out)
    assert set(lines) == {prefix[:-2] for prefix in FOUR_LINES}, out
    assert lines["Communication Optimization"] in ("Active", "Inactive")
    # Run from the checkout (the test runs with the repository on PYTHONPATH), upstream's op list
    # imported a second copy of the accelerator package, whose detection warned a second time.
    assert (out + err).count("Setting accelerator to CPU") <= 1, err


def test_ds_report_heterogeneous_with_config(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 8, "heterogeneous_config": {"enabled": true, '
                      '"load_balancing_strategy": "manual", "micro_batch_sizes": [6, 2]}}')
    code, out, err = run([str(BIN / "ds_report"), "--heterogeneous", "--config", str(config)], cwd=tmp_path)
    assert code == 0, err
    lines = report_lines(out)
    assert lines["Heterogeneous Environment"] == "Enabled"
    assert lines["Load Balancing Strategy"] == "Manual"
    # Without the launcher's DS_ACCELERATOR: upstream's op list imported the accelerator package a
    # second time (the tree's root is on sys.path), whose detection warned again.
    assert (out + err).count("Setting accelerator to CPU") <= 1, err


def test_bad_config_is_one_line_with_exit_2(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{"heterogeneous_config": {"enabled": true, "strategy": "fast"}}')
    code, out, err = run([str(BIN / "deepspeed"), "env_report", "--heterogeneous", "--config", str(config)],
                         cwd=tmp_path)
    assert code == 2
    assert "heterogeneous_config.strategy: unknown key 'strategy'" in err
    assert "Traceback" not in err


def test_plain_ds_report_shows_the_fork_version(tmp_path):
    code, out, err = run([str(BIN / "ds_report"), "--hide_operator_status"], cwd=tmp_path)
    assert code == 0, err
    assert "+hetero." in next(line for line in out.splitlines() if line.startswith("deepspeed info"))
    assert "fork revision" in next(line for line in out.splitlines() if line.startswith("deepspeed-hetero"))


def test_bad_environment_value_stops_the_launch(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    code, out, err = run([str(BIN / "deepspeed"), "--num_gpus", "1", str(script)], cwd=tmp_path,
                         env={"DS_HETEROGENEOUS_ENV": "maybe"})
    assert code != 0
    assert "DS_HETEROGENEOUS_ENV='maybe': use one of 1/true/yes/on or 0/false/no/off" in err
    assert "must not run" not in out + err and "Traceback" not in err


@pytest.mark.parametrize("config_args", [["--deepspeed_config", "{path}"], ["--deepspeed_config={path}"],
                                         ["--deepscale_config", "{path}"]])
def test_invalid_fork_block_stops_the_launch_with_one_line(tmp_path, config_args):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 8, "heterogeneous_config": {"enabled": true, "profile_step": 3}}')
    user_args = [arg.format(path=config) for arg in config_args]
    code, out, err = run([str(BIN / "deepspeed"), "--num_gpus", "1", str(script), *user_args], cwd=tmp_path)
    assert code == 2, err
    failure = [line for line in err.splitlines() if line.startswith("deepspeed: invalid DeepSpeed config")]
    assert failure == [f"deepspeed: invalid DeepSpeed config {config}: heterogeneous_config.profile_step: unknown key "
                       "'profile_step'; did you mean 'profile_steps'? allowed keys: check_fed_batch, communication, "
                       "elastic, emulation, enabled, load_balancing_strategy, loss_items, "
                       "micro_batch_sizes, mixed_precision_support, pipeline, profile_steps, resplit_fed_batches, "
                       "return_outputs, scheduler"]
    assert (out + err).count("profile_step: unknown key") == 1
    assert "must not run" not in out + err and "Traceback" not in err


def test_launch_check_reads_the_config_argument_and_leaves_unreadable_files_to_upstream(tmp_path, capsys):
    from deepspeed.runtime.heterogeneous.cli.launcher import check_launch_environment, config_path_in
    assert config_path_in(["train.py", "--deepspeed_config", "a.json", "--deepspeed_config=b.json"]) == "b.json"
    assert config_path_in(["--num_gpus", "2", "train.py", "--deepscale_config", "c.json"]) == "c.json"
    assert config_path_in(["train.py", "--deepspeed", "--lr", "0.1"]) is None
    assert config_path_in(["train.py", "--deepspeed_config"]) is None
    broken = tmp_path / "broken.json"
    broken.write_text('{"heterogeneous_config": ')
    good = tmp_path / "good.json"
    good.write_text('{"heterogeneous_config": {"enabled": true, "emulation": {"speeds": [1.0, 0.5, 0.5]}}}')
    for path in (tmp_path / "missing.json", broken, good):  # the last one is valid for a world of 3
        check_launch_environment(["train.py", "--deepspeed_config", str(path)], environ={})
    assert capsys.readouterr().err == ""


def test_multinode_launch_forwards_the_fork_variables(tmp_path):
    # pdsh stands in for the remote shell only (there is no second node here); the runner's
    # real code builds the command line that every node would execute.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "pdsh").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_PDSH_OUT"\n')
    (fake_bin / "pdsh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodea slots=1\nnodeb slots=1\n")
    captured = tmp_path / "pdsh.args"
    code, out, err = run([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--launcher", "pdsh",
                          "--no_ssh_check", "--master_addr", "127.0.0.1", "train.py"], cwd=tmp_path,
                         env={"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_PDSH_OUT": str(captured),
                              "DS_HETEROGENEOUS_ENV": "1", "DS_ADAPTIVE_SCHEDULING": "true"})
    assert code == 0, err
    remote_command = captured.read_text()
    assert "export DS_HETEROGENEOUS_ENV=1;" in remote_command
    assert "export DS_ADAPTIVE_SCHEDULING=true;" in remote_command


def test_a_busy_master_port_is_one_line_naming_it(tmp_path):
    import socket
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out, err = run([str(BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(port), str(script)],
                             cwd=tmp_path)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("deepspeed: error:")]
    assert len(lines) == 1 and f"port {port} (--master_port) is already in use on this host" in lines[0], err
    assert "--master_port " in lines[0].split("e.g.")[-1] and "Traceback" not in err and "must not run" not in out + err


def test_a_launch_warns_once_per_job_not_once_per_process(tmp_path):
    """The accelerator is detected once per launch (the local launcher and ranks inherit
    DS_ACCELERATOR), and torch's deprecation warning about upstream's collectives comes from
    global rank 0 alone: a two-rank run warns "Setting accelerator to CPU" once (six times before),
    and the deprecation at most once. The ZeRO collectives call torch's non-deprecated names (no
    deprecation under torch 2.13, formerly one per call site); loading the cached shm op says
    nothing (formerly a line per rank), nor is CUDA_VISIBLE_DEVICES announced without a GPU."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, deepspeed\n"
        "model = torch.nn.Linear(8, 8)\n"
        "config = {'train_batch_size': 4, 'zero_optimization': {'stage': 2},\n"
        "          'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1, 'torch_adam': True}},\n"
        "          'heterogeneous_config': {'enabled': True, 'load_balancing_strategy': 'manual',\n"
        "                                   'micro_batch_sizes': [3, 1]}}\n"
        "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
        "x = torch.randn(engine.heterogeneous_plan.micro_batch_sizes[engine.global_rank], 8)\n"
        "engine.backward(engine(x).pow(2).mean())\n"
        "engine.step()\n"
        "print('TRAINED', flush=True)\n"
        "torch.distributed.destroy_process_group()\n")
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    proc = subprocess.run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(script)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    output = proc.stdout + proc.stderr
    # Both ranks trained (their exit status is upstream's teardown: gloo may abort a rank on exit).
    assert output.count("TRAINED") == 2, output[-4000:]
    assert output.count("Setting accelerator to CPU") == 1, output[-4000:]
    assert output.count("is deprecated. Please use") <= 1, output[-4000:]
    assert "all_gather_into_tensor` is deprecated" not in output, output[-4000:]
    assert "reduce_scatter_tensor` is deprecated" not in output, output[-4000:]
    assert "built successfully" not in output, output[-4000:]
    if "Setting accelerator to CPU" in output:
        assert "Setting CUDA_VISIBLE_DEVICES" not in output, output[-4000:]
