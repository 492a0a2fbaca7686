# SPDX-License-Identifier: Apache-2.0
"""What a job leaves behind under the real ``deepspeed`` launcher: no shared-memory all-reduce
buffers in /dev/shm (normal exit, kill -9), and no process after SIGINT/SIGTERM to the runner."""

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from harness import deepspeed_launcher, fork_environment, free_port, remove_shm_buffers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

NUM_RANKS = 2
START_TIMEOUT_S = 240  # start-up imports deepspeed and loads the shm op in every rank
STOP_TIMEOUT_S = 60  # launch.py gives ranks 30 s after SIGTERM before it kills them

# Every rank: initialise DeepSpeed's CPU backend (which sets up the shm all-reduce), check an
# all-reduce through the process group and one through each shm path (small and large
# messages), mark itself started, then either exit or keep "training" until stopped.
RANK_SCRIPT = """
import argparse, pathlib, time
import torch
import deepspeed
import deepspeed.comm as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--marks")
parser.add_argument("--forever", action="store_true")
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
# Otherwise inference_all_reduce silently falls back to the process group.
assert deepspeed.comm.comm.cdb.shm_comm_op is not None, "no shm all-reduce op"
assert deepspeed.comm.comm.cdb.shm_vector_kernel_level >= 1, "shm all-reduce needs AVX2 for fp32"
rank, world = dist.get_rank(), dist.get_world_size()
expected = world * (world + 1) / 2
for numel in (16, 1 << 20):  # 64 B and 4 MiB: the symmetric and the distributed shm paths
    reduced = torch.full((numel, ), float(rank + 1))
    dist.all_reduce(reduced)
    assert torch.all(reduced == expected), "process-group all-reduce"
    reduced = torch.full((numel, ), float(rank + 1))
    dist.inference_all_reduce(reduced)
    assert torch.all(reduced == expected), "shm all-reduce"
pathlib.Path(args.marks, f"started_{rank}").write_text(str(__import__("os").getpid()))
while args.forever:
    time.sleep(0.2)
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
"""


def shm_buffers(port):
    # Upstream names each rank's buffer deepspeed_allreduce_buffer_<uid>_<master addr>_<master
    # port>_<rank>; the port is this job's own, so concurrent jobs do not count.
    return {path.name for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")}


def start_job(tmp_path, port, forever):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, **fork_environment(), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // NUM_RANKS)))
    command = [deepspeed_launcher(), "--num_gpus", str(NUM_RANKS), "--master_port", str(port), str(script),
               "--marks", str(marks)] + (["--forever"] if forever else [])
    log = open(tmp_path / "job.log", "w")
    # A session of its own, so that clean-up can reach every process of the job at once.
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    return proc, marks


def output_tail(tmp_path):
    return (tmp_path / "job.log").read_text()[-6000:]


def wait_until_started(proc, marks, tmp_path):
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(list(marks.glob("started_*"))) < NUM_RANKS:
        assert proc.poll() is None, f"job exited with {proc.returncode} before its ranks started:\n" + \
            output_tail(tmp_path)
        assert time.monotonic() < deadline, "ranks did not start in time:\n" + output_tail(tmp_path)
        time.sleep(0.2)
    return [int(mark.read_text()) for mark in marks.glob("started_*")]


def end_job(proc, port):
    """Whatever the test found, leave no process and no buffer of this job behind."""
    for victim in [proc.pid] + [child.pid for child in _descendants(proc.pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)
    remove_shm_buffers(port)


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_normal_exit_leaves_no_shm_buffers(tmp_path):
    port = free_port()
    proc, marks = start_job(tmp_path, port, forever=False)
    try:
        wait_until_started(proc, marks, tmp_path)
        proc.wait(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, output_tail(tmp_path)
        assert shm_buffers(port) == set()
    finally:
        end_job(proc, port)


def test_kill_9_leaves_no_shm_buffers(tmp_path):
    # Not even a signal handler runs here: the buffers must be gone before the job is killed.
    port = free_port()
    proc, marks = start_job(tmp_path, port, forever=True)
    try:
        wait_until_started(proc, marks, tmp_path)
        assert shm_buffers(port) == set(), "the names must go at start-up, while the job runs"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
        psutil.wait_procs(_descendants(proc.pid), timeout=STOP_TIMEOUT_S)
        assert shm_buffers(port) == set()
    finally:
        end_job(proc, port)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_runner_stops_the_whole_job(tmp_path, signum):
    port = free_port()
    proc, marks = start_job(tmp_path, port, forever=True)
    try:
        rank_pids = wait_until_started(proc, marks, tmp_path)
        job = [psutil.Process(proc.pid)] + _descendants(proc.pid)  # runner, launch.py, ranks
        assert set(rank_pids) <= {process.pid for process in job}
        os.kill(proc.pid, signum)  # the runner only, as `kill` or a scheduler would
        proc.wait(timeout=STOP_TIMEOUT_S)
        _, alive = psutil.wait_procs(job, timeout=STOP_TIMEOUT_S)
        assert alive == [], f"still running {STOP_TIMEOUT_S}s after {signum.name} to the runner: " + \
            ", ".join(f"{p.pid} {' '.join(p.cmdline()[:3])}" for p in alive if p.is_running())
        assert proc.returncode != 0, "an interrupted job must not report success"
        assert shm_buffers(port) == set()
    finally:
        end_job(proc, port)
