# SPDX-License-Identifier: Apache-2.0
"""Every error seen once (config/errors.py): the decision without processes, and real failures under
the deepspeed launcher and torchrun (tests/unit/scripts/failure_report.py): an error one rank raises
is printed once, by that rank, named by it, while its peer waits in an agreement; an error every rank
raises is printed once, on one line for the fork's errors and as one traceback for others."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO_ROOT, fork_environment, free_port, launch_deepspeed
from deepspeed.runtime.heterogeneous.config.errors import report_line

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "failure_report.py"


def _post(kind="MemoryPlacementError", message="no placement fits", consequence=False, fork=True):
    return {"kind": kind, "message": message, "consequence": consequence, "line": f"{kind}: {message}",
            "fork": fork}


def test_an_error_every_rank_raised_is_printed_once_by_the_lowest_rank():
    posts = {rank: _post() for rank in range(4)}
    assert report_line(0, posts[0], posts, 4) == "MemoryPlacementError: no placement fits"
    assert [report_line(rank, posts[rank], posts, 4) for rank in (1, 2, 3)] == [None] * 3
    generic = {rank: _post("AssertionError", "train_batch_size", fork=False) for rank in range(2)}
    assert report_line(0, generic[0], generic, 2) == "traceback" and report_line(1, generic[1], generic, 2) is None


def test_an_error_some_ranks_raised_is_named_by_its_rank_and_the_others_point_to_it():
    broken = _post("PlanAgreementError", "could not gather ... (Connection closed by peer)", consequence=True)
    posts = {0: broken, 1: broken, 3: _post(message="rank 3 needs 2 GiB"), 2: broken}
    assert report_line(3, posts[3], posts, 4) == "global rank 3: MemoryPlacementError: rank 3 needs 2 GiB"
    assert report_line(0, broken, posts, 4) == ("deepspeed-hetero: global rank 0 stopped because global rank 3 failed "
                                               "(MemoryPlacementError; its message is printed by that rank)")
    # Two ranks of four raise the same: the lower prints it once, naming both.
    posts = {0: broken, 1: _post(), 2: _post(), 3: broken}
    assert report_line(1, posts[1], posts, 4) == "global rank 1 (and [2]): MemoryPlacementError: no placement fits"
    assert report_line(2, posts[2], posts, 4) is None
    # A broken collective with no peer's reason: the rank's own report is all there is.
    assert report_line(0, broken, {0: broken}, 2) == "traceback"


def _torchrun(case):
    env = {**os.environ, **fork_environment(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(SCRIPT), "--case", case]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


LAUNCHERS = {"deepspeed": lambda case: launch_deepspeed(SCRIPT, ["--case", case], timeout=240), "torchrun": _torchrun}


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_real_failure_is_printed_once(launcher):
    run = LAUNCHERS[launcher]
    code, output = run("some")
    assert code != 0
    assert output.count("global rank 1: MemoryPlacementError: data-parallel rank 1 needs 2 GiB") == 1, output[-4000:]
    code, output = run("every")
    assert code != 0
    assert output.count("MemoryPlacementError: no placement fits") == 1, output[-4000:]
    assert "global rank 0: MemoryPlacementError" not in output, "every rank raised it: no rank is named"
    code, output = run("generic")
    assert code != 0
    assert output.count("AssertionError: Check batch related parameters") == 1, output[-4000:]
