# SPDX-License-Identifier: Apache-2.0
"""Emulated memory as a physical limit: a memory cgroup per rank (``emulation.memory_gb``), the
memory limit a process runs under from outside as its capacity on the CPU accelerator, and the
cgroups' life cycle (removed at exit, stale ones of killed runs removed at the next start).

The pure parts read fake cgroup trees under ``tmp_path``. The real ones need root and a writable
memory controller; elsewhere they skip with the reason, except in CI, where they must run.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepspeed.runtime.heterogeneous.emulation import cgroups
from deepspeed.runtime.heterogeneous.emulation.cgroups import (ProcessCgroup, find_hierarchy, memory_limit,
                                                               oom_kill_report, oom_kills, owner_pid,
                                                               parse_memory_limit, placement, proc_cgroup_path,
                                                               remove_stale_cgroups)
from deepspeed.runtime.heterogeneous.config.settings import EmulationConfig
from deepspeed.runtime.heterogeneous.measure.devices import cpu_memory_capacity
from deepspeed.runtime.heterogeneous.emulation.emulator import (HOST_ALLOWANCE_BYTES, memory_limit_bytes,
                                                                start_memory_limit)
from harness import REPO_ROOT, fork_environment, launch_deepspeed, run_ranks

GIB = 2**30
MIB = 2**20
V1_UNLIMITED = "9223372036854771712\n"
PROC_V1 = "5:cpu,cpuacct:/\n4:memory:/jobs/job7/task0\n1:name=systemd:/x\n0::/\n"
PROC_V2 = "0::/jobs.slice/job7/task0\n"


def _tree(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _v1_tree(tmp_path, limits):
    """A v1 memory hierarchy with ``limits`` ({relative cgroup: limit text}) and its root."""
    files = {"memory/cgroup.procs": "", "memory/memory.limit_in_bytes": V1_UNLIMITED}
    for cgroup, limit in limits.items():
        files[f"memory/{cgroup}/cgroup.procs"] = ""
        files[f"memory/{cgroup}/memory.limit_in_bytes"] = limit
    return _tree(tmp_path, files)


def _v2_tree(tmp_path, limits, subtree=()):
    files = {"cgroup.controllers": "cpuset cpu io memory pids\n", "cgroup.procs": "",
             "cgroup.subtree_control": "cpu memory\n"}
    for cgroup, limit in limits.items():
        files[f"{cgroup}/memory.max"] = limit
        files[f"{cgroup}/cgroup.subtree_control"] = "memory cpu\n" if cgroup in subtree else ""
    return _tree(tmp_path, files)


# -- pure: parsing and placement -------------------------------------------------------------


def test_proc_cgroup_lines_v1_and_v2():
    assert proc_cgroup_path(PROC_V1, "memory") == "/jobs/job7/task0"
    assert proc_cgroup_path(PROC_V1, "cpu") == "/"  # a combined "cpu,cpuacct" mount
    assert proc_cgroup_path(PROC_V1) == "/"
    assert proc_cgroup_path(PROC_V2) == "/jobs.slice/job7/task0"
    assert proc_cgroup_path(PROC_V2, "memory") is None


@pytest.mark.parametrize("text, expected", [("max\n", None), (V1_UNLIMITED, None), ("1073741824\n", GIB),
                                            ("0\n", 0), ("", None)])
def test_limit_values_v1_and_v2(text, expected):
    assert parse_memory_limit(text) == expected


def test_hierarchies_are_found_where_the_controller_is(tmp_path):
    v1 = _v1_tree(tmp_path / "v1", {"jobs/job7/task0": V1_UNLIMITED})
    hierarchy = find_hierarchy("memory", v1, PROC_V1)
    assert (hierarchy.version, hierarchy.mount, hierarchy.current) == (1, v1 / "memory", "/jobs/job7/task0")
    assert hierarchy.current_dir == v1 / "memory/jobs/job7/task0" == placement(hierarchy)
    assert find_hierarchy("cpu", v1, PROC_V1) is None  # no cpu mount in this tree
    # Without a cgroup namespace a container sees its host's path; its own cgroup is the mount.
    assert find_hierarchy("memory", v1, "4:memory:/docker/abc\n").current_dir == v1 / "memory"
    v2 = _v2_tree(tmp_path / "v2", {"jobs.slice": "max\n", "jobs.slice/job7": "max\n",
                                    "jobs.slice/job7/task0": "max\n"}, subtree=("jobs.slice", "jobs.slice/job7"))
    hierarchy = find_hierarchy("memory", v2, PROC_V2)
    assert (hierarchy.version, hierarchy.mount) == (2, v2)
    # A v2 leaf that holds the process cannot have children with controllers: its parent, which
    # hands memory down, takes the rank's cgroup (still under the job's limit).
    assert placement(hierarchy) == v2 / "jobs.slice/job7"
    assert placement(find_hierarchy("memory", v2, "0::/\n")) == v2


def test_memory_limit_is_the_smallest_along_the_path(tmp_path):
    v1 = _v1_tree(tmp_path / "v1", {"jobs": V1_UNLIMITED, "jobs/job7": str(2 * GIB), "jobs/job7/task0": str(3 * GIB)})
    assert memory_limit(v1, PROC_V1) == 2 * GIB
    assert memory_limit(_v1_tree(tmp_path / "none", {"jobs/job7/task0": V1_UNLIMITED}), PROC_V1) is None
    v2 = _v2_tree(tmp_path / "v2", {"jobs.slice": str(GIB), "jobs.slice/job7": "max\n",
                                    "jobs.slice/job7/task0": "max\n"})
    assert memory_limit(v2, PROC_V2) == GIB
    # The fork's own emulation cgroup is not a limit from outside: memory_gb already describes it.
    own = _v1_tree(tmp_path / "own", {"jobs/job7/task0/deepspeed-hetero-1-rank0": str(MIB)})
    assert memory_limit(own, "4:memory:/jobs/job7/task0/deepspeed-hetero-1-rank0\n") is None
    assert memory_limit(tmp_path / "no-cgroups", PROC_V1) is None


def test_cpu_capacity_is_the_cgroup_limit_when_smaller_than_the_ram():
    ram = 64 * GIB
    assert cpu_memory_capacity(ram, True, None) == (ram, True)
    assert cpu_memory_capacity(ram, True, 128 * GIB) == (ram, True)  # a limit above the RAM limits nothing
    # A rank limited from outside plans for its own limit, which no other rank shares.
    assert cpu_memory_capacity(ram, True, 6 * GIB) == (6 * GIB, False)


def test_stale_cgroups_are_those_of_dead_processes(tmp_path):
    for name in ("deepspeed-hetero-101-rank0", "deepspeed-hetero-102", "deepspeed-hetero-103-rank1",
                 "deepspeed-hetero-x", "other-104"):
        (tmp_path / name).mkdir()
    (tmp_path / "deepspeed-hetero-102" / "inside").mkdir()  # still holds a process: cannot be removed
    alive = {103, 104}.__contains__
    removed = remove_stale_cgroups(tmp_path, alive=alive)
    assert [p.name for p in removed] == ["deepspeed-hetero-101-rank0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepspeed-hetero-102", "deepspeed-hetero-103-rank1",
                                                          "deepspeed-hetero-x", "other-104"]
    assert [owner_pid(n) for n in ("deepspeed-hetero-7-rank3", "deepspeed-hetero-8", "deepspeed-hetero-")] == [
        7, 8, None]


def test_oom_kill_report_names_the_rank_and_its_limit(tmp_path):
    limit = memory_limit_bytes(0.5)
    v1 = _v1_tree(tmp_path / "v1", {})
    killed = v1 / "memory" / "deepspeed-hetero-4242-rank1"
    _tree(killed, {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
                   "memory.limit_in_bytes": str(limit)})
    assert oom_kills(killed, 1) == 1
    message = oom_kill_report(4242, v1, "4:memory:/\n", remove=False)
    assert "data-parallel rank 1 (pid 4242) was killed by the kernel because it exceeded its emulated memory" in message
    assert "memory_gb 0.5 + 0.25 GiB for the host process" in message, message
    # A process that died otherwise (no OOM kill recorded) is not blamed on its memory.
    v2 = _v2_tree(tmp_path / "v2", {"deepspeed-hetero-77-rank0": str(limit)})
    (v2 / "deepspeed-hetero-77-rank0" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 0\noom_kill 0\n")
    assert oom_kill_report(77, v2, "0::/\n", remove=False) is None
    assert oom_kill_report(78, v2, "0::/\n") is None


def test_on_v2_cpu_and_memory_share_the_process_cgroup(tmp_path):
    """A v2 process is in one cgroup: the speed and the memory emulation must use the same one, and
    it goes only when both are done with it. Each controller is handed down by the parent."""
    root = _tree(tmp_path, {"cgroup.controllers": "cpu memory\n", "cgroup.procs": "",
                            "cgroup.subtree_control": "cpu\n"})
    memory = ProcessCgroup.acquire(find_hierarchy("memory", root, "0::/\n"))
    assert (root / "cgroup.subtree_control").read_text() == "+memory"  # what the kernel is asked
    cpu = ProcessCgroup.acquire(find_hierarchy("cpu", root, "0::/\n"), label="rank0")
    assert cpu is memory and memory.users == 2 and memory.path == root / f"deepspeed-hetero-{os.getpid()}"
    memory.release()
    assert memory.path.is_dir() and ProcessCgroup._open.get(root) is memory
    cpu.release()
    assert not memory.path.exists() and root not in ProcessCgroup._open


def test_dilation_mode_never_uses_a_cgroup():
    """'dilation' is the no-root mode: memory_gb by accounting alone, and no cgroup is touched."""
    assert start_memory_limit(EmulationConfig(memory_gb=[0.5, 0.5], mode="dilation"), 1) is None
    assert start_memory_limit(EmulationConfig(speeds=[1.0, 0.5]), 0) is None  # no memory_gb
    assert memory_limit_bytes(2) == 2 * GIB + HOST_ALLOWANCE_BYTES


# -- real memory cgroups -----------------------------------------------------------------------


def _memory_cgroups_unusable():
    """Why this machine cannot run the real cgroup tests, or None."""
    if os.geteuid() != 0:
        return "not root"
    hierarchy = find_hierarchy("memory")
    if hierarchy is None:
        return "no memory controller mounted"
    parent = placement(hierarchy)
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    return None


@pytest.fixture
def memory_cgroups():
    reason = _memory_cgroups_unusable()
    if reason is not None:
        assert os.environ.get("CI") != "true", f"CI must run the memory cgroup tests: {reason}"
        pytest.skip(f"memory cgroups unusable here: {reason}")
    parent = placement(find_hierarchy("memory"))
    before = {p.name for p in parent.glob("deepspeed-hetero-*")}
    yield parent
    assert {p.name for p in parent.glob("deepspeed-hetero-*")} <= before, "cgroups left behind"


CHILD = textwrap.dedent("""
    import sys, time
    from deepspeed.runtime.heterogeneous.emulation.emulator import MemoryLimitCgroup
    cgroup = MemoryLimitCgroup(int(sys.argv[1]), label="rank1")
    print("cgroup", cgroup.path, flush=True)
    data = b"x" * int(sys.argv[2])  # every page written: charged
    print("survived", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _child(limit, allocate, sleep=0.0):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(limit), str(allocate), str(sleep)], cwd=REPO_ROOT,
                            env={**os.environ, **fork_environment()}, stdout=subprocess.PIPE, text=True)


def _reports(proc, count):
    """The child's next ``count`` reports ('cgroup <path>', 'survived'); '' once it is gone."""
    reports = []
    while len(reports) < count:
        line = proc.stdout.readline()
        if not line or line.startswith(("cgroup ", "survived")):
            reports.append(line.strip())
    return reports


def test_a_process_over_its_limit_is_killed_one_within_survives_none_is_left(memory_cgroups):
    parent = memory_cgroups
    # A run killed by SIGKILL skips atexit: its cgroup stays until the next start.
    sleeper = _child(300 * MIB, 0, sleep=60)
    stale = Path(_reports(sleeper, 1)[0].split(" ", 1)[1])
    assert stale.parent == parent and stale.is_dir()
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait() == -signal.SIGKILL and stale.is_dir()
    # 300 MiB from the moment it joined, 100 MiB written: it survives, removes the stale cgroup as
    # it starts and its own at exit.
    within = _child(300 * MIB, 100 * MIB)
    own = Path(_reports(within, 2)[0].split(" ", 1)[1])
    assert within.wait() == 0 and not own.exists() and not stale.exists()
    # 1 GiB written: the kernel kills it (SIGKILL, 137 in a shell), as a device runs out of memory.
    over = _child(300 * MIB, GIB)
    killed_cgroup, survived = _reports(over, 2)
    killed_cgroup = killed_cgroup.split(" ", 1)[1]
    assert over.wait() == -signal.SIGKILL and survived == ""
    assert Path(killed_cgroup).is_dir() and oom_kills(Path(killed_cgroup), find_hierarchy("memory").version) == 1
    message = oom_kill_report(over.pid)
    assert f"data-parallel rank 1 (pid {over.pid}) was killed by the kernel because it exceeded its emulated " \
           "memory" in message, message
    assert not Path(killed_cgroup).exists()  # the report removes the dead rank's cgroup


MEMORY_GB = [0.25, 0.5]


def _train_under_memory_cgroup(rank, world_size):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "profile_steps": 2,
                                       "emulation": {"memory_gb": MEMORY_GB, "mode": "cgroup"}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # Joined as the engine started, before the optimizer's state was allocated.
    path = proc_cgroup_path(Path("/proc/self/cgroup").read_text(), "memory") or proc_cgroup_path(
        Path("/proc/self/cgroup").read_text())
    losses = []
    for _ in range(4):
        inputs = torch.randn(engine.train_micro_batch_size_per_gpu(), 32)
        loss = torch.nn.functional.mse_loss(engine(inputs), inputs)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    runtime = engine.heterogeneous_state.runtime
    cgroup = runtime.limits.memory_cgroup.cgroup
    return {"pid": os.getpid(), "path": path, "cgroup": str(cgroup.path), "memory_mode": runtime.limits.memory_mode,
            "limit": int((cgroup.path / cgroups.memory_limit_file(find_hierarchy("memory").version)).read_text()),
            "losses": losses}


@pytest.mark.multiprocess
def test_two_ranks_train_within_their_memory_cgroups_which_are_removed_at_exit(memory_cgroups):
    results = run_ranks(_train_under_memory_cgroup, world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result["path"].endswith(f"/deepspeed-hetero-{result['pid']}-rank{rank}"), result
        assert result["memory_mode"] == "cgroup"
        page = os.sysconf("SC_PAGE_SIZE")
        assert result["limit"] == memory_limit_bytes(MEMORY_GB[rank]) // page * page, result
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result
        assert not Path(result["cgroup"]).exists(), "a rank's cgroup outlived it"


OOM_SCRIPT = textwrap.dedent("""
    import argparse, torch, deepspeed
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(8, 8)
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "heterogeneous_config": {"enabled": True, "profile_steps": 0,
                                       "emulation": {"memory_gb": [1.0, 0.01], "mode": "cgroup"}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if engine.global_rank == 1:
        hoard = [torch.ones(64 * 2**20 // 4) for _ in range(64)]  # 4 GiB, far past 0.01 GiB + the allowance
    torch.distributed.barrier()
    print("rank", engine.global_rank, "was not stopped", flush=True)
""")


@pytest.mark.multiprocess
def test_the_launcher_says_which_rank_its_emulated_memory_killed(memory_cgroups, tmp_path):
    script = tmp_path / "hoard.py"
    script.write_text(OOM_SCRIPT)
    returncode, output = launch_deepspeed(script, num_ranks=2, timeout=120)
    assert returncode != 0, output[-4000:]
    assert "data-parallel rank 1 (pid" in output and "was killed by the kernel because it exceeded its emulated " \
           "memory" in output, output[-4000:]
    assert "memory_gb 0.01 + 0.25 GiB" in output, output[-4000:]
    assert "rank 1 was not stopped" not in output
    # The surviving rank fails with its peer (the launcher ends it), it does not wait out a
    # collective time-out; the launch's own 120 s guards a hang.
    assert "Timeout" not in output and "timed out" not in output, output[-4000:]
