# SPDX-License-Identifier: Apache-2.0
"""The ds_config ``deepspeed plan`` emits for this machine's kind of cluster (2 CPU ranks) is one
the fork accepts: launched through the real ``deepspeed`` launcher, it trains the planned model
(``examples/tiny_gpt``'s demo size) a few steps."""

import json

import pytest

from harness import REPO_ROOT, launch_deepspeed

from deepspeed.runtime.heterogeneous.cli.plan import main as plan_main

CLUSTER = REPO_ROOT / "examples" / "clusters" / "cluster_cpu_2ranks.json"
SCRIPT = REPO_ROOT / "examples" / "train_heterogeneous.py"
STEPS = 7  # the script measures samples/s from step 5 on


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_emitted_ds_config_trains_on_two_cpu_ranks(tmp_path, capsys):
    config = tmp_path / "ds_config.json"
    assert plan_main(["--cluster", str(CLUSTER), "--ds-config", str(config), "--no-largest"]) == 0
    capsys.readouterr()
    emitted = json.loads(config.read_text())
    assert emitted["heterogeneous_config"]["enabled"] and emitted["zero_optimization"]["stage"] == 1
    code, output = launch_deepspeed(SCRIPT, ["--deepspeed_config", config, "--steps", STEPS], num_ranks=2,
                                    timeout=500, cwd=REPO_ROOT)
    assert code == 0, output[-6000:]
    steps = [json.loads(line) for line in output.splitlines() if line.startswith('{"step"')]
    assert [s["step"] for s in steps] == list(range(STEPS)), output[-6000:]
    assert all(sum(s["plan"]) * emitted["gradient_accumulation_steps"] == emitted["train_batch_size"] for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
