"""Tests of the multi-process harness itself: results, failures, hangs and sub-cases."""

import os
import subprocess
import time

import psutil
import pytest
import torch

from harness import run_ranks, run_subcases

# The harness enforces its own time-outs; pytest-timeout is the backstop should the harness hang,
# generous because the first test's set-up may build the shm comm op (minutes on two cores).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def sum_ranks_plus_one(rank, world_size):
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return {
        "tensor": tensor,
        "backend": dist.get_backend(),
        "accelerator": get_accelerator().device_name(),
        "env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_SIZE"]),
        "world_size": world_size,
    }


def test_run_ranks_returns_each_ranks_value():
    results = run_ranks(sum_ranks_plus_one, world_size=2, timeout=60)
    assert all(torch.equal(r["tensor"], torch.tensor([3.0])) for r in results)
    assert [r["env"] for r in results] == [("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert {(r["backend"], r["accelerator"], r["world_size"]) for r in results} == {("gloo", "cpu", 2)}


def explode_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    import torch
    import torch.distributed as dist

    # Rank 0 waits for a peer that never comes: its error or the failure grace must end the
    # group, not the 60 s time-out.
    dist.all_reduce(torch.ones(1))


def test_failing_rank_reports_its_traceback_and_does_not_wait_for_timeout():
    with pytest.raises(AssertionError) as failure:
        run_ranks(explode_on_rank_one, world_size=2, timeout=60)
    message = str(failure.value)
    assert "rank 1 raised:" in message
    assert "Traceback (most recent call last)" in message
    assert "in explode_on_rank_one" in message
    assert "ValueError: rank one exploded on purpose" in message
    # The group ended on the failure: a rank still waiting would be listed as killed at the time-out.
    assert "timed out after" not in message, message


def hang_on_rank_one(rank, world_size, pid_file):
    if rank == 1:
        # A grandchild proves that the whole tree is killed, not just the rank.
        sleeper = subprocess.Popen(["sleep", "600"])
        with open(pid_file, "w") as handle:
            handle.write(str(sleeper.pid))
        time.sleep(600)


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_hanging_rank_is_named_and_killed_with_its_children(tmp_path, capfd):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pid_file = tmp_path / "sleeper.pid"
    timeout = 20
    with pytest.raises(AssertionError) as failure:
        run_ranks(hang_on_rank_one, world_size=2, timeout=timeout, args=(str(pid_file), ))
    assert f"timed out after {timeout}s; ranks still running (killed): [1]" in str(failure.value)
    # Before it was killed, the rank printed where it hung.
    err = capfd.readouterr().err
    assert "rank1 (pid" in err and "in hang_on_rank_one" in err and "Current thread" in err, err[-3000:]
    assert _gone(int(pid_file.read_text()))
    # multiprocessing's resource tracker starts with this process's first spawn and lives as long as it.
    leftovers = [p for p in psutil.Process().children(recursive=True)
                 if p.pid not in before and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]
    assert not leftovers, f"processes left behind: {[(p.pid, p.cmdline()) for p in leftovers]}"


def reduce_case(rank, world_size, value, fail_on_rank=None):
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor)
    # Fails after the collective, so the peers stay in step and later cases can still run.
    assert rank != fail_on_rank, f"case value={value} failing on rank {rank} on purpose"
    return tensor.item()


def test_subcases_return_values_per_case_and_rank():
    cases = [{"value": 1}, {"value": 2.5}, {"value": -4}]
    assert run_subcases(reduce_case, cases, world_size=2, timeout=60) == [[2.0, 2.0], [5.0, 5.0], [-8.0, -8.0]]


def test_subcases_report_every_failing_case_by_its_parameters():
    cases = [{"value": 1}, {"value": 2, "fail_on_rank": 0}, {"value": 3}, {"value": 4, "fail_on_rank": 1}]
    with pytest.raises(AssertionError) as failure:
        run_subcases(reduce_case, cases, world_size=2, timeout=60)
    message = str(failure.value)
    assert "case 1 {value=2, fail_on_rank=0} failed on rank 0:" in message
    assert "case value=2 failing on rank 0 on purpose" in message
    assert "case 3 {value=4, fail_on_rank=1} failed on rank 1:" in message
    assert "case 0 " not in message and "case 2 " not in message
