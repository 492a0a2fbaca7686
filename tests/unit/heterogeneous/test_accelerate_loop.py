# SPDX-License-Identifier: Apache-2.0
"""A stock Hugging Face Accelerate loop, unchanged, with the fork's config in its DeepSpeedPlugin:

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step(); optimizer.zero_grad()

Accelerate feeds every rank an equal batch; the engine re-splits them into the plan (rank 1
emulated at a tenth of rank 0's speed; profiling moves work, then ``reschedule_workload``) and
returns the outputs to the ranks fed them. The reference is plain torch in one process on the
union of what the ranks were fed at each step (gathered by the test itself).

The same loop also runs as a script, tests/unit/scripts/accelerate_loop.py, in real processes
started by the ``deepspeed`` launcher and by ``accelerate launch`` (``--use_deepspeed``: its
single-node DeepSpeed path starts the ranks with torchrun; ``--cpu`` would start one process)."""

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import (REPO_ROOT, _kill_process_tree, fork_environment, free_port, launch_deepspeed,
                     remove_shm_buffers, run_subcases)

accelerate = pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_loop.py"
SCRIPT_CASES = ["mse", "accuracy"]


def _load_script():
    spec = importlib.util.spec_from_file_location("accelerate_loop", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _accelerate_loop(rank, world_size, metric):
    """The script's loop (tests/unit/scripts/accelerate_loop.py), in a harness rank."""
    return _load_script().accelerate_loop(rank, world_size, metric)


@pytest.mark.multiprocess
def test_a_stock_accelerate_loop_is_exact_and_follows_the_plan():
    script = _load_script()
    cases = [dict(metric=False), dict(metric=True)]
    for case, (first, second) in zip(cases, run_subcases(_accelerate_loop, cases, world_size=2, timeout=900)):
        assert first["plans"] == second["plans"], case
        plans = first["plans"]
        assert any(plan != [8, 8] for plan in plans[:script.PROFILE]), (case, plans)  # profiling's plans moved rows
        assert plans[script.RESCHEDULE_AT][1] > plans[script.RESCHEDULE_AT][0], (case, plans)  # reschedule: back
        for result in (first, second):
            assert result["params"] < 1e-6 and result["outputs"] < 1e-5, (case, result["params"], result["outputs"])
            for accuracy, expected in result["metrics"]:
                assert accuracy == pytest.approx(expected), (case, result["metrics"])


# -- the same loop under the launchers ----------------------------------------------------------


def _script_args(out, launcher):
    args = ["--out", out, "--launcher", launcher]
    for case in SCRIPT_CASES:
        args += ["--case", case]
    return args


def _check_launched_run(out, launcher):
    """The assertions of the in-harness test, on the files each rank of the script wrote."""
    script = _load_script()
    for case in SCRIPT_CASES:
        first, second = (torch.load(out / f"{launcher}-{case}-rank{rank}.pt") for rank in range(2))
        assert first["plans"] == second["plans"], case
        plans = first["plans"]
        assert len(plans) == script.STEPS, (case, plans)
        assert any(plan != [8, 8] for plan in plans[:script.PROFILE]), (case, plans)  # profiling's plans
        assert plans[script.RESCHEDULE_AT][1] > plans[script.RESCHEDULE_AT][0], (case, plans)  # reschedule: back
        for result in (first, second):
            assert result["params"] < 1e-6 and result["outputs"] < 1e-5, (case, result["params"], result["outputs"])
            assert bool(result["metrics"]) == (case == "accuracy"), (case, result["metrics"])
            for accuracy, expected in result["metrics"]:
                assert accuracy == pytest.approx(expected), (case, result["metrics"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_loop_launched_by_deepspeed_is_exact_and_follows_the_plan(tmp_path):
    code, output = launch_deepspeed(SCRIPT, _script_args(tmp_path, "deepspeed"), num_ranks=2, timeout=240,
                                    cwd=REPO_ROOT)
    assert code == 0, f"deepspeed-launched Accelerate loop failed (exit {code}):\n{output[-6000:]}"
    _check_launched_run(tmp_path, "deepspeed")


def _launch_accelerate(script, script_args, num_ranks, timeout, hf_home):
    """``accelerate launch --use_deepspeed``: on one machine Accelerate's DeepSpeed launcher runs
    torchrun in-process (``torch.distributed.run``), which sets RANK/WORLD_SIZE/LOCAL_RANK; the
    script's DeepSpeedPlugin then makes the Accelerator call ``deepspeed.init_distributed``, gloo
    on the CPU accelerator. ``--cpu`` is no way to DeepSpeed: it excludes ``--use_deepspeed``, and
    its launcher starts one process (several only through mpirun with ``--mpirun_hostfile``).
    Returns ``(returncode, output)``; a run over ``timeout`` is killed with every rank."""
    port = free_port()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
               "--num_processes", str(num_ranks), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(port), str(script), *map(str, script_args)]
    variables = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_ranks))),
        **fork_environment(),
        # No `accelerate config` default of this machine's user (read from HF_HOME) may join in.
        "HF_HOME": str(hf_home),
    }
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: the launcher's process group alone
        # would leave them running.
        _kill_process_tree(proc.pid)
        output, _ = proc.communicate()
        raise AssertionError(f"accelerate launch did not finish within {timeout}s (killed): {' '.join(command)}\n"
                             f"--- output tail ---\n{output[-8000:]}") from None
    finally:
        if proc.poll() is None:
            _kill_process_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        remove_shm_buffers(port)
    return proc.returncode, output


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_loop_launched_by_accelerate_is_exact_and_follows_the_plan(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, output = _launch_accelerate(SCRIPT, _script_args(out, "accelerate"), num_ranks=2, timeout=240,
                                      hf_home=tmp_path / "hf_home")
    assert code == 0, f"accelerate-launched Accelerate loop failed (exit {code}):\n{output[-6000:]}"
    _check_launched_run(out, "accelerate")
