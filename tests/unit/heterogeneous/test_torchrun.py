# SPDX-License-Identifier: Apache-2.0
"""Runs launched by ``torchrun`` (torch's own launcher, not ``deepspeed``): the engine's loader
and a stock loader re-split by the engine train exactly through a plan change, and a stock loader
with re-splitting off is refused on every rank with the fed-batch message."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import REPO_ROOT, fork_environment, free_port

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_train.py"


def _torchrun(tmp_path, loader):
    env = {**os.environ, **fork_environment(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(SCRIPT), "--out", str(tmp_path), "--loader", loader]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=240)
    files = [tmp_path / f"{loader}-rank{rank}.pt" for rank in range(2)]
    assert proc.returncode == 0 and all(f.exists() for f in files), (proc.stdout + proc.stderr)[-6000:]
    return [torch.load(f) for f in files]


def _reference(script, fed):
    """One process, plain torch: SGD on the union of what the ranks were fed at each step."""
    model = script.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    _, inputs, targets = script.dataset().tensors
    for rows in fed:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        optimizer.step()
    return list(model.parameters())


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("torchrun_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
@pytest.mark.parametrize("loader", ["engine", "stock"])
def test_torchrun_trains_exactly_through_a_plan_change(tmp_path, loader):
    script = _script()
    ranks = _torchrun(tmp_path, loader)
    plans = ranks[0]["plans"]
    assert ranks[1]["plans"] == plans == [[8, 8]] * script.CHANGE_AT + [[12, 4]] * (script.STEPS - script.CHANGE_AT)
    sizes = [[len(rows) for rows in run["fed"]] for run in ranks]
    # The engine's loader feeds the plan; the stock loader equal shares, which the engine re-splits.
    assert sizes == ([[p[r] for p in plans] for r in range(2)] if loader == "engine" else [[8] * script.STEPS] * 2)
    fed = [a + b for a, b in zip(ranks[0]["fed"], ranks[1]["fed"])]
    for rank in range(2):
        assert ranks[rank]["error"] is None
        for got, want in zip(ranks[rank]["params"], _reference(script, fed)):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


@pytest.mark.multiprocess
def test_torchrun_refuses_a_stock_loader_when_re_splitting_is_off(tmp_path):
    script = _script()
    for run in _torchrun(tmp_path, "refused"):
        assert run["plans"][-1] == [12, 4] and len(run["plans"]) == script.CHANGE_AT + 1, run["plans"]
        assert "was fed a micro-batch of 8 samples" in run["error"] and "plan in force gives it" in run["error"], run
