# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous training across emulated hosts (``scripts/emulated_cluster.py``): network
namespaces on a bridge, each with its own shaped link, CPU quota and memory limit, every host
started by the real ``deepspeed`` launcher without ssh.

- 2 hosts x 2 ranks: the exactness checks (ZeRO 0-3 with uneven manual sizes, compute_aware with
  a plan change) against a single-process reference; each rank described by its local rank; the
  topology sees two hosts and a measured link near the tc rate.
- 2 + 1 ranks: uneven hosts.
- Teardown leaves no namespace, link or cgroup, also when a run fails, on SIGTERM, and (at the
  next start) after SIGKILL.

Building namespaces needs root and iproute2: elsewhere these tests skip with the reason, except
under ``CI=true``, where they fail instead (CI must run them). The pure helpers are tested
everywhere.
"""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import harness
from references import adam_mse_reference

SCRIPTS = harness.REPO_ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import emulated_cluster as ec  # noqa: E402

TRAIN = harness.REPO_ROOT / "tests" / "unit" / "scripts" / "multihost_train.py"
RATE_MBIT = 200
GIB = 2**30


@pytest.fixture(scope="module")
def cluster_machine():
    """Skip (or, under CI=true, fail) where namespaces cannot be built."""
    reason = ec.available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, but the emulated multi-host tests cannot run here: {reason}")
        pytest.skip(reason)


def cgroups_left(run_id):
    """Cgroups of this test process's clusters still present (any controller)."""
    return [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/**/{ec.host_cgroup_name(run_id, '')}*")]


def assert_nothing_left(cluster):
    assert cluster.leftovers() == [], cluster.leftovers()
    assert cgroups_left(cluster.run_id) == []
    assert not any(name.startswith(f"{ec.PREFIX}-{cluster.run_id}-") for name in ec._namespaces() + ec._links())


def load_ranks(out, world_size):
    return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def reference(step_indices):
    sys.path.insert(0, str(TRAIN.parent))
    import multihost_train
    _, inputs, targets = multihost_train.dataset().tensors
    return adam_mse_reference(multihost_train.make_model(), inputs, targets, step_indices, multihost_train.LR)


def check_exact(results, case):
    """Every rank's parameters equal one process trained on each step's samples of all ranks."""
    step_indices = [sum((r["cases"][case]["seen"][step] for r in results), [])
                    for step in range(len(results[0]["cases"][case]["seen"]))]
    assert sorted(i for step in step_indices for i in step) == list(range(96)), case
    expected = reference(step_indices)
    for rank, result in enumerate(results):
        for got, want in zip(result["cases"][case]["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case} rank {rank}: {m}")


def launch(cluster, out, cases, timeout=420, env=None, launcher="deepspeed"):
    run = cluster.launch_deepspeed(TRAIN, ["--out", out, "--cases", ",".join(cases)],
                                   env={**harness.fork_environment(), **(env or {})}, timeout=timeout,
                                   master_port=harness.free_port(), launcher=launcher)
    assert run.ok, run.describe()
    return load_ranks(out, cluster.world_size), run


# -- the real cluster ---------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_two_hosts_of_two_ranks_train_exactly_through_the_real_launcher(cluster_machine, tmp_path):
    specs = [ec.HostSpec(ranks=2, rate_mbit=RATE_MBIT, cpus=1.0, memory_gb=6)] * 2
    with ec.EmulatedCluster(specs) as cluster:
        # The link is shaped: never above its tc rate (payload: a few % under it, for frame headers);
        # how close to it a loaded machine's processes come is bench_communication.py's.
        measured = cluster.measure_rate(1, 0)
        assert 0.3 * RATE_MBIT * 1e6 < measured < 1.02 * RATE_MBIT * 1e6, measured
        before = [cluster.link_counters(k) for k in range(2)]
        results, run = launch(cluster, tmp_path, ["zero0", "zero1", "zero2", "zero3", "compute_aware"])
        crossed = [cluster.link_counters(k) - before[k] for k in range(2)]
    assert_nothing_left(cluster)

    for case in ("zero0", "zero1", "zero2", "zero3", "compute_aware"):
        check_exact(results, case)
    ca = results[0]["cases"]["compute_aware"]
    # Host 1's ranks run at a quarter speed: profiling moves work to host 0, or keeps the start-up
    # plan where its steps cannot tell the speeds from the noise (per rank the machine's other load
    # adds noise: by host); never the other way.
    assert ca["start_plan"] == [4, 4, 4, 4] and sum(ca["plan"][:2]) >= sum(ca["plan"][2:]), ca["plan"]
    for rank, result in enumerate(results):
        env = result["env"]
        assert env["CROSS_RANK"] == str(rank // 2) and env["LOCAL_RANK"] == str(rank % 2), env
        assert env["GLOO_SOCKET_IFNAME"] == "eth1"
        assert result["memory_limit"] == 6 * GIB, "a rank sees its host's memory cgroup from inside the namespace"
        # Each rank's device description is its own host's device (its local rank), not device 0.
        assert result["cases"]["compute_aware"]["device_local_ranks"] == [0, 1, 0, 1]
        for case in result["cases"].values():
            topology = case["topology"]
            assert topology["hosts"] == [0, 0, 1, 1] and topology["source"] == "CROSS_RANK"
            assert case["local_ranks"] == [0, 1, 0, 1]
            bandwidth = topology["leader_bandwidths"][1] * 8
            assert 0.2 * RATE_MBIT * 1e6 < bandwidth < 1.05 * RATE_MBIT * 1e6, topology
    # Rank 0's start-up plan block names the hosts and the measured link.
    assert "  topology: 2 hosts (ranks 0,1 | 2,3), inter-host " in run.outputs[0], run.outputs[0][-3000:]
    # Training crossed the link in both directions; loopback inside a host does not touch it.
    assert all(c.sent > 1e5 and c.received > 1e5 for c in crossed), crossed


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_uneven_hosts_two_ranks_and_one(cluster_machine, tmp_path):
    specs = [ec.HostSpec(ranks=2, rate_mbit=RATE_MBIT), ec.HostSpec(ranks=1, rate_mbit=RATE_MBIT / 2)]
    with ec.EmulatedCluster(specs) as cluster:
        assert cluster.ranks_of(0) == [0, 1] and cluster.ranks_of(1) == [2]
        # The fork's switches set where each host's launcher starts reach that host's ranks.
        results, _ = launch(cluster, tmp_path, ["zero2", "compute_aware"], env={"DS_ADAPTIVE_SCHEDULING": "false"})
    assert_nothing_left(cluster)
    for case in ("zero2", "compute_aware"):
        check_exact(results, case)
    for rank, result in enumerate(results):
        env = result["env"]
        assert env["CROSS_RANK"] == str(rank // 2) and env["LOCAL_SIZE"] == ("2" if rank < 2 else "1"), env
        assert env["DS_ADAPTIVE_SCHEDULING"] == "false"
        topology = result["cases"]["zero2"]["topology"]
        assert topology["hosts"] == [0, 0, 1] and result["cases"]["zero2"]["local_ranks"] == [0, 1, 0]
        # The path from host 0 to host 1 runs at host 1's (slower) rate.
        assert 0.2 * RATE_MBIT / 2 * 1e6 < topology["leader_bandwidths"][1] * 8 < 1.05 * RATE_MBIT / 2 * 1e6
    assert results[0]["cases"]["compute_aware"]["device_local_ranks"] == [0, 1, 0]


@pytest.mark.multiprocess
def test_torchrun_on_every_host_as_docs_multihost_recipe_runs_it(cluster_machine, tmp_path):
    """docs/multihost.md's torchrun recipe, the same command on every host (its node rank, host 0's
    address): the fork finds the hosts from torchrun's GROUP_RANK and trains exactly."""
    specs = [ec.HostSpec(ranks=1, rate_mbit=RATE_MBIT)] * 2
    with ec.EmulatedCluster(specs) as cluster:
        results, run = launch(cluster, tmp_path, ["zero2"], launcher="torchrun")
    assert_nothing_left(cluster)
    check_exact(results, "zero2")
    for rank, result in enumerate(results):
        assert result["env"]["CROSS_RANK"] is None and result["env"]["RANK"] == str(rank)
        topology = result["cases"]["zero2"]["topology"]
        assert topology["hosts"] == [0, 1] and topology["source"] == "GROUP_RANK", topology
    assert "  topology: 2 hosts (ranks 0 | 1), inter-host " in run.outputs[0], run.outputs[0][-3000:]


FAILING = """
import os, sys, time
if os.environ["CROSS_RANK"] == "1":
    sys.exit(3)
time.sleep(120)   # host 0 would wait for host 1 forever
"""

HOLDER = """
import sys, time
sys.path.insert(0, {scripts!r})
import emulated_cluster as ec
cluster = ec.EmulatedCluster([ec.HostSpec(ranks=1, rate_mbit=50, cpus=0.5, memory_gb=1)] * 2).start()
cluster.popen(0, ["sleep", "300"])
print(cluster.run_id, flush=True)
time.sleep(300)
"""


def start_holder():
    """A process that builds a cluster (with cgroups and a process inside), prints its run id, waits."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER.format(scripts=str(SCRIPTS))], stdout=subprocess.PIPE,
                               text=True, env=dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT)))
    run_id = process.stdout.readline().strip()
    assert run_id, "the cluster holder did not start"
    return process, run_id


def names_of(run_id):
    return [n for n in ec._namespaces() + ec._links() if n.startswith(f"{ec.PREFIX}-{run_id}-")]


def cgroups_of(run_id):
    return cgroups_left(run_id)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_teardown_leaves_nothing_after_a_failed_run_sigterm_or_sigkill(cluster_machine, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    with ec.EmulatedCluster([ec.HostSpec(ranks=1, cpus=1.0, memory_gb=2)] * 2) as cluster:
        run = cluster.launch_deepspeed(script, env=harness.fork_environment(), timeout=200, failure_grace=3,
                                       master_port=harness.free_port())
        assert cgroups_left(cluster.run_id), "the hosts' cgroups exist while the cluster runs"
    # The failed host ended the run (its failure grace), not the time-out.
    assert not run.ok and not run.timed_out and run.returncodes[1] != 0, run.describe()
    assert_nothing_left(cluster)

    # SIGTERM: the holder's handler tears its cluster down before it exits.
    holder, run_id = start_holder()
    assert names_of(run_id) and cgroups_of(run_id)
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=30)
    assert names_of(run_id) == [] and cgroups_of(run_id) == []

    # SIGKILL skips every handler: the next start removes what the dead process left.
    holder, run_id = start_holder()
    holder.kill()
    holder.wait(timeout=30)
    assert names_of(run_id) and cgroups_of(run_id), "a killed run leaves its namespaces and cgroups"
    workdirs = lambda: list(Path(tempfile.gettempdir()).glob(f"{ec.PREFIX}-{run_id}-*"))  # noqa: E731
    assert workdirs(), "a killed run leaves its scratch directory (hostfile)"
    removed = ec.remove_stale()
    assert names_of(run_id) == [] and cgroups_of(run_id) == [] and workdirs() == [], removed


# -- pure helpers -------------------------------------------------------------------------------


def test_names_carry_the_owner_pid_and_run_and_fit_interface_names():
    bridge, hosts = ec.cluster_layout([ec.HostSpec(2), ec.HostSpec(1)], owner_pid=4194304, run=35, subnet=7)
    assert bridge == "dsh-2hwcg-z-br"
    assert [h.namespace for h in hosts] == ["dsh-2hwcg-z-h0", "dsh-2hwcg-z-h1"]
    assert [h.veth for h in hosts] == ["dsh-2hwcg-z-v0", "dsh-2hwcg-z-v1"]
    assert [h.address for h in hosts] == ["10.7.0.1", "10.7.0.2"]
    assert all(len(name) <= 15 for name in [bridge] + [h.veth for h in hosts])
    assert ec.owner_of("dsh-2hwcg-z-h1") == 4194304 and ec.owner_of("eth0") is None
    assert ec.stale_names(["dsh-2hwcg-z-br", "dsh-1-0-v0", "eth0"], alive=lambda pid: pid == 1) == ["dsh-2hwcg-z-br"]
    assert ec.hostfile_text(hosts) == "host0 slots=2\nhost1 slots=1\n"
    assert ec.host_cgroup_name("2hwcg-z", 1) == "deepspeed-hetero-cluster-2hwcg-z-host1"
    assert ec.cgroup_owner_of("deepspeed-hetero-cluster-2hwcg-z-host1") == 4194304
    # Not a per-rank cgroup (decimal pid): a rank's memory_limit() counts its host's limit.
    assert ec.cgroups_module().owner_pid("deepspeed-hetero-cluster-2hwcg-z-host1") is None


def test_bad_host_specs_are_refused_by_name():
    with pytest.raises(ValueError, match="HostSpec.ranks must be an integer >= 1, got 0"):
        ec.HostSpec(ranks=0)
    with pytest.raises(ValueError, match="HostSpec.rate_mbit must be > 0 or None"):
        ec.HostSpec(ranks=1, rate_mbit=0)
    with pytest.raises(ValueError, match="at least one host"):
        ec.cluster_layout([], 1, 0)


def test_links_are_shaped_by_tbf_or_counted_by_pfifo_and_their_counters_parsed():
    command = ec.shaping_command("eth1", 200)
    assert command[:7] == ["tc", "qdisc", "replace", "dev", "eth1", "root", "tbf"]
    assert command[command.index("rate") + 1] == "200000kbit"
    assert ec.shaping_command("v0", None)[-1] == "pfifo"
    text = ("qdisc tbf 8001: root refcnt 3 rate 100Mbit burst 32Kb lat 50ms\n"
            " Sent 17632130 bytes 12923 pkt (dropped 0, overlimits 12058 requeues 0)\n")
    assert ec.parse_tc_sent(text) == (17632130, 12923)
    with pytest.raises(ValueError, match="no 'Sent N bytes' counter"):
        ec.parse_tc_sent("qdisc noqueue 0: root")
    assert (ec.LinkCounters(10, 20) - ec.LinkCounters(4, 5)) == ec.LinkCounters(6, 15)


def test_a_host_process_joins_its_cgroups_outside_and_remounts_them_inside_the_namespace():
    mounts = ("tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
              "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
              "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
              "proc /proc proc rw 0 0\n")
    remounts = ec.cgroup_remounts(mounts)
    # /sys/fs/cgroup of the namespace's fresh sysfs takes no directories: a tmpfs goes there first.
    assert remounts == ["mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup",
                        "mkdir -p /sys/fs/cgroup/cpu && mount -t cgroup -o rw,relatime,cpu cgroup /sys/fs/cgroup/cpu",
                        "mkdir -p /sys/fs/cgroup/memory && mount -t cgroup -o rw,relatime,memory cgroup "
                        "/sys/fs/cgroup/memory"]
    assert ec.cgroup_remounts("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n") == [
        "mkdir -p /sys/fs/cgroup && mount -t cgroup2 -o rw,nsdelegate cgroup2 /sys/fs/cgroup"]
    argv = ec.host_argv("ns0", ["deepspeed", "x.py"], ["/cg/cpu/h0/cgroup.procs"], remounts[1:2])
    assert argv[:3] == ["sh", "-c", "echo $$ > /cg/cpu/h0/cgroup.procs && exec \"$@\""]
    assert argv[4:10] == ["ip", "netns", "exec", "ns0", "sh", "-c"]
    assert argv[10].startswith("mkdir -p /sys/fs/cgroup/cpu") and argv[10].endswith('exec "$@"')
    assert argv[-2:] == ["deepspeed", "x.py"]
    assert ec.host_argv("ns0", ["true"])[:4] == ["ip", "netns", "exec", "ns0"]


def test_every_host_runs_the_deepspeed_launcher_without_ssh_at_its_node_rank():
    _, hosts = ec.cluster_layout([ec.HostSpec(2), ec.HostSpec(1)], 10, 0)
    argv = ec.deepspeed_host_argv(hosts[1], "10.211.0.1", 29600, "/tmp/hostfile", "train.py", ["--a", 1],
                                  launcher="deepspeed")
    assert argv == ["deepspeed", "--hostfile", "/tmp/hostfile", "--no_ssh", "--node_rank", "1", "--master_addr",
                    "10.211.0.1", "--master_port", "29600", "train.py", "--a", "1"]
