#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""An emulated multi-host cluster on one machine: H "hosts" as network namespaces on one bridge.

Tests (``tests/unit/heterogeneous/test_multihost.py``), benchmarks and the multi-host demo run the
fork across hosts without a second machine. Each host gets:

- a network namespace ``dsh-<run>-h<k>`` whose end of a veth pair is named ``eth1`` (so one
  ``GLOO_SOCKET_IFNAME=eth1`` serves every host) with address ``10.<subnet>.0.<k+1>/24``; the other
  end, ``dsh-<run>-v<k>``, is a port of the bridge ``dsh-<run>-br``. Ranks of one host talk over
  the namespace's own loopback route (unshaped); ranks of different hosts cross both veths.
- its own link rate: a ``tbf`` qdisc on both directions of its veth (the host-side end's egress
  carries traffic *to* the host, ``eth1``'s egress traffic *from* it). A transfer between two
  hosts runs at the smaller of their rates. Links without a rate get a ``pfifo`` qdisc instead,
  so that every link has the same ``tc -s`` byte counters (``link_counters``). The kernel this was
  built on has no ``netem``, so links have no added delay: only their rate differs. Loopback gloo
  moves only 3-6 Gbit/s on two cores, so keep inter-host rates at or below ~300 Mbit/s to keep the
  in-host/inter-host ratio of a real cluster.
- its own CPU quota and memory limit: a cgroup per host, ``deepspeed-hetero-cluster-<run>-host<k>``
  (placed as ``deepspeed/runtime/heterogeneous/emulation/cgroups.py`` places a rank's), which the host's
  launcher joins before it enters the namespace, so every process of the host (launcher, ranks,
  loader workers) shares one quota, as on a real machine. Its name carries no decimal pid, so
  ``cgroup_files.memory_limit`` counts it as a limit from outside (a rank plans within its host's
  memory) and the fork's per-rank emulation cgroups nest inside it. ``ip netns exec`` mounts the
  namespace's own sysfs over ``/sys``, which hides ``/sys/fs/cgroup``; the wrapper mounts the
  machine's cgroup hierarchies there again, so that a rank sees its host's memory limit and the
  fork's per-rank emulation cgroups nest inside the host's.

Processes are launched through the real DeepSpeed launcher on every host, without ssh:
``ip netns exec NS deepspeed --hostfile H --no_ssh --node_rank K --master_addr <host 0> ...``. The
hostfile gives each host its own slot count (``host0 slots=2`` / ``host1 slots=1``), from which
every host's launcher derives the same world (DeepSpeed numbers ranks host by host). Every
namespace shares the machine's hostname, which ``/etc/hosts`` maps to 127.0.0.1, so the launchers
are given host 0's address, never a name.

Teardown happens on ``close()``, on leaving a ``with`` block, at interpreter exit, and on
SIGINT/SIGTERM/SIGHUP (the handlers tear down, then defer to the previous handler). A run killed
with SIGKILL leaves its namespaces, links and cgroups behind: every name carries the creating
process's pid, and every start removes those whose process is gone.

Needs root, ``ip`` and ``tc`` (``available()`` says why not).

Command line (one run of a training script across the emulated hosts)::

    python scripts/emulated_cluster.py --ranks 2,2 --rate-mbit 200 -- \\
        examples/snippets/train.py --deepspeed_config examples/configs/seed.json
    python scripts/emulated_cluster.py --ranks 2,1 --rate-mbit 200,20 --measure   # link rates only
    python scripts/emulated_cluster.py --cleanup                                # stale runs only
"""

import argparse
import atexit
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PREFIX = "dsh"
# dsh-<owner pid, base 36>-<run, base 36>-<br | v<k> | h<k>>; interface names have 15 characters.
NAME_RE = re.compile(r"^dsh-([0-9a-z]+)-([0-9a-z]+)-(br|v\d+|h\d+)$")
# deepspeed-hetero-cluster-<owner pid, base 36>-<run>-host<k>: not a per-rank cgroup of emulation/cgroups.py
# (whose names carry a decimal pid), so a rank counts its host's memory limit as one set from outside.
CGROUP_PREFIX = "deepspeed-hetero-cluster-"
CGROUP_RE = re.compile(r"^deepspeed-hetero-cluster-([0-9a-z]+)-([0-9a-z]+)-host\d+$")
INTERFACE = "eth1"
DEFAULT_SUBNET = 211
CFS_PERIOD_US = 10_000  # as the fork's per-rank emulation: smooth at the scale of a micro-step
RATE_WARNING_MBIT = 300

_sequence = itertools.count()
_open_clusters = []
_lock = threading.Lock()
_saved_handlers = {}


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or a command in it failed."""


def base36(number):
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, rest = divmod(number, 36)
        text = digits[rest] + text
        if number == 0:
            return text


# -- pure pieces --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostSpec:
    """One emulated host: how many ranks it runs and what it may use (None: no limit)."""

    ranks: int = 1
    rate_mbit: Optional[float] = None
    """The rate of this host's link to the bridge, in Mbit/s, each direction."""
    cpus: Optional[float] = None
    """CPU quota of the whole host, in CPUs (1.5: one and a half cores' time)."""
    memory_gb: Optional[float] = None
    """Memory limit of the whole host, in GiB."""

    def __post_init__(self):
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"HostSpec.ranks must be an integer >= 1, got {self.ranks!r}")
        for name in ("rate_mbit", "cpus", "memory_gb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"HostSpec.{name} must be > 0 or None (no limit), got {value!r}")


@dataclass(frozen=True)
class HostLayout:
    """The names and address of host ``index`` of one run."""

    index: int
    namespace: str
    veth: str
    address: str
    spec: HostSpec

    @property
    def hostfile_name(self):
        return f"host{self.index}"


def run_names(owner_pid, run):
    """(run id, bridge name) of run number ``run`` of process ``owner_pid``."""
    run_id = f"{base36(owner_pid)}-{base36(run)}"
    return run_id, f"{PREFIX}-{run_id}-br"


def cluster_layout(specs: Sequence[HostSpec], owner_pid, run, subnet=DEFAULT_SUBNET):
    """(bridge, [HostLayout]) of a run: every name carries the owner's pid and the run number."""
    if not specs:
        raise ValueError("an emulated cluster needs at least one host")
    if len(specs) > 250:
        raise ValueError(f"at most 250 hosts fit one /24, got {len(specs)}")
    if not 0 <= int(subnet) <= 255:
        raise ValueError(f"subnet must be the second octet of 10.<subnet>.0.0/24 (0-255), got {subnet!r}")
    run_id, bridge = run_names(owner_pid, run)
    hosts = [HostLayout(k, f"{PREFIX}-{run_id}-h{k}", f"{PREFIX}-{run_id}-v{k}", f"10.{int(subnet)}.0.{k + 1}", spec)
             for k, spec in enumerate(specs)]
    for name in [bridge] + [h.veth for h in hosts]:
        if len(name) > 15:
            raise ValueError(f"interface name {name!r} is longer than the kernel's 15 characters")
    return bridge, hosts


def owner_of(name):
    """The owner pid in a name of this module's (namespace, bridge or veth), else None."""
    match = NAME_RE.match(name)
    return int(match.group(1), 36) if match else None


def host_cgroup_name(run_id, index):
    return f"{CGROUP_PREFIX}{run_id}-host{index}"


def cgroup_owner_of(name):
    """The owner pid in a host cgroup's name, else None."""
    match = CGROUP_RE.match(name)
    return int(match.group(1), 36) if match else None


def stale_names(names, alive):
    """The names of this module's whose owner process is gone (``alive(pid)`` False)."""
    return [name for name in names if owner_of(name) is not None and not alive(owner_of(name))]


def hostfile_text(hosts: Sequence[HostLayout]):
    """A DeepSpeed hostfile: one line per host with its own slot count (uneven hosts allowed)."""
    return "".join(f"{host.hostfile_name} slots={host.spec.ranks}\n" for host in hosts)


def shaping_command(device, rate_mbit):
    """The ``tc`` arguments that give ``device``'s egress ``rate_mbit`` (tbf), or a plain pfifo
    (no limit, but the same byte counters) when ``rate_mbit`` is None."""
    if rate_mbit is None:
        return ["tc", "qdisc", "replace", "dev", device, "root", "pfifo"]
    bytes_per_s = rate_mbit * 1e6 / 8
    # The bucket must hold at least one timer tick's worth of bytes (HZ >= 100 here) and a few
    # full-size frames; 4 ms of traffic, at least 64 KiB, keeps tbf within ~10% of its rate.
    burst = max(64 * 1024, int(bytes_per_s * 0.004))
    return ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(rate_mbit * 1000)}kbit",
            "burst", str(burst), "latency", "100ms"]


_SENT_RE = re.compile(r"Sent (\d+) bytes (\d+) pkt")


def parse_tc_sent(text):
    """(bytes, packets) that the root qdisc of a ``tc -s qdisc show dev X`` text has sent."""
    match = _SENT_RE.search(text)
    if match is None:
        raise ValueError(f"no 'Sent N bytes' counter in tc output: {text[:200]!r}")
    return int(match.group(1)), int(match.group(2))


def cgroup_remounts(mounts_text, root="/sys/fs/cgroup"):
    """Shell commands that mount again, in the mount namespace ``ip netns exec`` made, the cgroup
    hierarchies that ``mounts_text`` (``/proc/self/mounts``) shows under ``root``."""
    commands = []
    found = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] not in ("cgroup", "cgroup2"):
            continue
        path = fields[1].replace("\\040", " ")
        if path == root or path.startswith(root + "/"):
            found.append((path, fields[2], fields[3]))
    if not found:
        return commands
    if not any(path == root for path, _, _ in found):
        commands.append(f"mount -t tmpfs -o mode=755 cgroup_root {shlex.quote(root)}")
    for path, kind, options in found:
        commands.append(f"mkdir -p {shlex.quote(path)} && mount -t {kind} -o {shlex.quote(options)} {kind} "
                        f"{shlex.quote(path)}")
    return commands


def host_argv(namespace, argv, procs_files=(), remounts=()):
    """The command that runs ``argv`` as a process of the emulated host: join the host's cgroups
    (``procs_files``: their ``cgroup.procs``) from outside, enter the namespace, mount the cgroup
    hierarchies again inside (``remounts``), exec ``argv``."""
    outside = "".join(f"echo $$ > {shlex.quote(str(path))} && " for path in procs_files)
    inside = "".join(f"{command} && " for command in remounts)
    inner = ["ip", "netns", "exec", namespace, "sh", "-c", inside + 'exec "$@"', "sh", *map(str, argv)]
    if not outside:
        return inner
    return ["sh", "-c", outside + 'exec "$@"', "sh", *inner]


def deepspeed_host_argv(host, master_addr, master_port, hostfile, script, script_args=(), launcher=None):
    """The ``deepspeed`` launcher command of one host: no ssh, its node rank, host 0's address."""
    launcher = launcher or str(Path(sys.executable).parent / "deepspeed")
    return [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(host.index), "--master_addr",
            master_addr, "--master_port", str(master_port), str(script), *map(str, script_args)]


def torchrun_host_argv(host, master_addr, master_port, nnodes, nproc_per_node, script, script_args=()):
    """The ``torchrun`` command of one host, as on real hosts: its node rank, host 0's address
    (static rendezvous); torchrun starts the same number of ranks on every host."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node",
            str(nproc_per_node), "--node_rank", str(host.index), "--master_addr", master_addr, "--master_port",
            str(master_port), str(script), *map(str, script_args)]


# -- machine checks -----------------------------------------------------------------------------


def available():
    """None when this machine can build emulated clusters, else the reason it cannot."""
    if os.geteuid() != 0:
        return "emulated clusters need root (network namespaces, veth, tc, cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated clusters need the '{tool}' command (iproute2), which is not installed"
    probe = f"{PREFIX}-{base36(os.getpid())}-probe-h0"  # a stale one is removed like a run's
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot create a network namespace here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _alive(pid):
    return Path(f"/proc/{pid}").exists()


def _run(argv, check=True):
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _namespaces():
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _links():
    result = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in result.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _namespace_pids(namespace):
    result = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def cgroups_module():
    """The fork's ``measure/cgroup_files.py`` (where the controllers are mounted, where a new cgroup
    goes), loaded from its file so that the command line does not import deepspeed (and torch) for
    it."""
    module = (sys.modules.get("deepspeed.runtime.heterogeneous.measure.cgroup_files")
              or sys.modules.get("_hetero_cgroup_files"))
    if module is None:
        import importlib.util
        path = REPO_ROOT / "deepspeed" / "runtime" / "heterogeneous" / "measure" / "cgroup_files.py"
        spec = importlib.util.spec_from_file_location("_hetero_cgroup_files", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_hetero_cgroup_files"] = module
        spec.loader.exec_module(module)
    return module


def _cgroup_parents():
    """The directories host cgroups go under, per controller ('cpu', 'memory') that is mounted."""
    cgroups = cgroups_module()
    parents = {}
    for controller in ("cpu", "memory"):
        try:
            hierarchy = cgroups.find_hierarchy(controller)
        except OSError:
            hierarchy = None
        if hierarchy is not None:
            parents[controller] = (hierarchy, cgroups.placement(hierarchy))
    return parents


def _cgroup_procs(path):
    pids = []
    for procs in Path(path).rglob("cgroup.procs"):
        try:
            pids += [int(pid) for pid in procs.read_text().split()]
        except OSError:
            pass
    return pids


def remove_cgroup_tree(path, timeout=10.0):
    """Kill what runs in the cgroup ``path`` and below, then remove it, children first."""
    path = Path(path)
    deadline = time.monotonic() + timeout
    while path.is_dir():
        _kill(_cgroup_procs(path))
        for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            try:
                child.rmdir()
            except OSError:
                pass
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


WORKDIR_RE = re.compile(r"^dsh-([0-9a-z]+)-([0-9a-z]+)-[0-9a-z_]+$")
"""A run's scratch directory (its hostfile, host logs) in the temporary directory."""


def remove_stale(alive=_alive):
    """Remove what runs of this module left when their process was killed (SIGKILL skips every
    teardown): namespaces, veths and bridges, host cgroups, scratch directories. Returns the names
    removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        match = WORKDIR_RE.match(path.name)
        if match and path.is_dir() and not alive(int(match.group(1), 36)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    namespaces = stale_names(_namespaces(), alive)
    for name in namespaces:
        _kill(_namespace_pids(name))
    # Host-side veths first (deleting one end deletes both at once; a namespace's deletion is
    # lazy), then namespaces, bridges last.
    for name in sorted(stale_names(_links(), alive), key=lambda n: n.endswith("-br")):
        if _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(name)
    for name in namespaces:
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    for hierarchy, parent in _cgroup_parents().values():
        for path in sorted(Path(parent).glob(CGROUP_PREFIX + "*")):
            pid = cgroup_owner_of(path.name)
            if pid is not None and not alive(pid) and path.is_dir():
                try:
                    remove_cgroup_tree(path, timeout=2.0)
                    removed.append(str(path))
                except OSError:
                    pass
    return removed


# -- the cluster --------------------------------------------------------------------------------


@dataclass
class HostRun:
    """One host's launcher process of a ``launch_deepspeed`` call."""

    host: HostLayout
    process: subprocess.Popen
    log_path: Path
    returncode: Optional[int] = None

    @property
    def output(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class ClusterRun:
    """What ``launch_deepspeed`` returns: each host's exit status and output, in host order."""

    returncodes: List[Optional[int]]
    outputs: List[str]
    timed_out: bool = False

    @property
    def ok(self):
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def describe(self, tail=6000):
        parts = [f"timed out: {self.timed_out}; host exit codes: {self.returncodes}"]
        for index, output in enumerate(self.outputs):
            parts.append(f"--- host {index} (exit {self.returncodes[index]}) ---\n{output[-tail:]}")
        return "\n".join(parts)


@dataclass(frozen=True)
class LinkCounters:
    """Bytes a host's link carried, from the ``tc -s`` counters of its two qdiscs."""

    sent: int
    """From the host to the bridge (``eth1``'s egress)."""
    received: int
    """From the bridge to the host (the host-side veth's egress)."""

    def __sub__(self, other):
        return LinkCounters(self.sent - other.sent, self.received - other.received)

    @property
    def total(self):
        return self.sent + self.received


class EmulatedCluster:
    """H emulated hosts on one machine; a context manager (``start`` on enter, ``close`` on exit).

    Args:
        hosts: a HostSpec per host, or an int per host (its rank count).
        subnet: the second octet of the hosts' addresses 10.<subnet>.0.<k+1>. Namespaces do not
            share routes, so concurrent runs may use the same subnet.
    """

    def __init__(self, hosts, subnet=DEFAULT_SUBNET):
        self.specs = [spec if isinstance(spec, HostSpec) else HostSpec(ranks=int(spec)) for spec in hosts]
        self.owner = os.getpid()
        self.run = next(_sequence)
        self.bridge, self.hosts = cluster_layout(self.specs, self.owner, self.run, subnet)
        self.run_id = run_names(self.owner, self.run)[0]
        self.cgroups: Dict[int, Dict[str, Path]] = {}
        self.workdir = None
        self.started = False
        self.closed = False
        self._processes = []
        self._remounts = []

    # -- life cycle --

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def master_addr(self):
        return self.hosts[0].address

    @property
    def world_size(self):
        return sum(spec.ranks for spec in self.specs)

    def ranks_of(self, index):
        """The global ranks of host ``index`` (DeepSpeed's launcher numbers ranks host by host)."""
        first = sum(spec.ranks for spec in self.specs[:index])
        return list(range(first, first + self.specs[index].ranks))

    def start(self):
        """Remove stale runs, then build the bridge, the hosts, their links and cgroups."""
        if self.started:
            return self
        reason = available()
        if reason is not None:
            raise ClusterError(reason)
        for spec in self.specs:
            if spec.rate_mbit is not None and spec.rate_mbit > RATE_WARNING_MBIT:
                print(f"[emulated_cluster] note: {spec.rate_mbit} Mbit/s is above ~{RATE_WARNING_MBIT} Mbit/s; "
                      "loopback gloo moves only 3-6 Gbit/s on two cores, so in-host traffic would be barely faster "
                      "than the link", file=sys.stderr)
        remove_stale()
        _register(self)
        self.started = True
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.run_id}-"))
            (self.workdir / "hostfile").write_text(hostfile_text(self.hosts))
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for host in self.hosts:
                self._add_host(host)
            try:
                self._remounts = cgroup_remounts(Path("/proc/self/mounts").read_text())
            except OSError:
                self._remounts = []
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, host):
        _run(["ip", "netns", "add", host.namespace])
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", INTERFACE, "netns", host.namespace])
        _run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE])
        _run(["ip", "-n", host.namespace, "link", "set", INTERFACE, "up"])
        _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
        _run(shaping_command(host.veth, host.spec.rate_mbit))
        _run(["ip", "netns", "exec", host.namespace, *shaping_command(INTERFACE, host.spec.rate_mbit)])
        self._add_cgroups(host)

    def _add_cgroups(self, host):
        spec = host.spec
        if spec.cpus is None and spec.memory_gb is None:
            return
        parents = _cgroup_parents()
        wanted = [c for c, value in (("cpu", spec.cpus), ("memory", spec.memory_gb)) if value is not None]
        missing = [c for c in wanted if c not in parents]
        if missing:
            raise ClusterError(f"host {host.index}: no cgroup {missing[0]} controller is mounted, so its "
                               f"{'cpus' if missing[0] == 'cpu' else 'memory_gb'} limit cannot be set")
        paths = self.cgroups.setdefault(host.index, {})
        for controller in wanted:
            hierarchy, parent = parents[controller]
            path = Path(parent) / host_cgroup_name(self.run_id, host.index)
            if hierarchy.version == 2:
                subtree = Path(parent) / "cgroup.subtree_control"
                if controller not in subtree.read_text().split():
                    subtree.write_text(f"+{controller}")
            path.mkdir(exist_ok=True)
            paths[controller] = path
            if controller == "cpu":
                quota = max(1000, int(spec.cpus * CFS_PERIOD_US))
                if (path / "cpu.max").exists():
                    (path / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
                else:
                    (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                    (path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                limit = int(spec.memory_gb * 2**30)
                if (path / "memory.max").exists():
                    (path / "memory.max").write_text(str(limit))
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit))

    def close(self):
        """Tear everything down (idempotent): processes, namespaces, links, cgroups, files."""
        if self.closed or not self.started:
            self.closed = True
            _unregister(self)
            return
        self.closed = True
        errors = []
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for host in self.hosts:
            _kill(_namespace_pids(host.namespace))
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"process {process.pid} did not exit")
        for host in self.hosts:
            _run(["ip", "link", "del", host.veth], check=False)  # both ends; the namespace's deletion is lazy
            _run(["ip", "netns", "del", host.namespace], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        for paths in self.cgroups.values():
            for path in paths.values():
                try:
                    remove_cgroup_tree(path)
                except OSError as exc:
                    errors.append(f"cgroup {path}: {exc}")
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        _unregister(self)
        if errors:
            print(f"[emulated_cluster] teardown of {self.run_id}: {'; '.join(errors)}", file=sys.stderr)

    def leftovers(self):
        """What of this run still exists (names, cgroup paths); empty after a clean teardown."""
        names = set(_namespaces()) | set(_links())
        left = [n for n in [self.bridge] + [h.namespace for h in self.hosts] + [h.veth for h in self.hosts]
                if n in names]
        left += [str(p) for paths in self.cgroups.values() for p in paths.values() if p.exists()]
        return left

    # -- running things on hosts --

    def host_argv(self, index, argv):
        """``argv`` as a process of host ``index`` (its cgroups, its namespace)."""
        procs = [path / "cgroup.procs" for path in self.cgroups.get(index, {}).values()]
        return host_argv(self.hosts[index].namespace, argv, procs, self._remounts)

    def host_environment(self, index, env=None):
        """os.environ for host ``index``'s processes: the CPU accelerator over ``eth1`` and an
        OpenMP thread count that shares the host's CPUs among its ranks, with ``env`` on top
        (None as a value removes a variable)."""
        spec = self.specs[index]
        cpus = spec.cpus if spec.cpus is not None else (os.cpu_count() or 1) / len(self.specs)
        variables = dict(os.environ)
        variables.update({
            "DS_ACCELERATOR": "cpu",
            "GLOO_SOCKET_IFNAME": INTERFACE,
            "OMP_NUM_THREADS": str(max(1, int(cpus // spec.ranks))),
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]]
                                                              if os.environ.get("PYTHONPATH") else [])),
        })
        for name, value in (env or {}).items():
            if value is None:
                variables.pop(name, None)
            else:
                variables[name] = str(value)
        return variables

    def popen(self, index, argv, env=None, **kwargs):
        """Start ``argv`` on host ``index`` in a session of its own; torn down with the cluster."""
        self._check_running()
        process = subprocess.Popen(self.host_argv(index, argv), env=self.host_environment(index, env),
                                   start_new_session=True, **kwargs)
        self._processes.append(process)
        return process

    def run_on(self, index, argv, env=None, timeout=60):
        """Run ``argv`` on host ``index``; returns the CompletedProcess (text output)."""
        self._check_running()
        return subprocess.run(self.host_argv(index, argv), env=self.host_environment(index, env),
                              capture_output=True, text=True, timeout=timeout)

    def launch_deepspeed(self, script, script_args=(), env=None, host_env=None, timeout=300, master_port=29500,
                         cwd=None, failure_grace=30.0, launcher="deepspeed"):
        """Run ``script`` on every host through a real launcher, the ``deepspeed`` one (no ssh) or
        ``torchrun`` (``launcher="torchrun"``, equal ranks per host); wait for all hosts. A host that
        fails gives the others ``failure_grace`` seconds (a peer's collective usually breaks at
        once; one blocked in a rendezvous would wait its whole time-out), then every host still
        running is killed, as on ``timeout``.

        Args:
            env: variables for every host; ``host_env``: per host index, on top.
        Returns a ClusterRun (each host's exit status and merged stdout/stderr).
        """
        self._check_running()
        if launcher not in ("deepspeed", "torchrun"):
            raise ClusterError(f"launcher {launcher!r}: use 'deepspeed' or 'torchrun'")
        ranks = {host.spec.ranks for host in self.hosts}
        if launcher == "torchrun" and len(ranks) != 1:
            raise ClusterError(f"torchrun starts the same number of ranks on every host; these hosts have "
                               f"{[host.spec.ranks for host in self.hosts]}")
        runs = []
        for host in self.hosts:
            if launcher == "torchrun":
                argv = torchrun_host_argv(host, self.master_addr, master_port, len(self.hosts), host.spec.ranks,
                                          script, script_args)
            else:
                argv = deepspeed_host_argv(host, self.master_addr, master_port, self.workdir / "hostfile", script,
                                           script_args)
            log_path = self.workdir / f"host{host.index}-{len(self._processes)}.log"
            with open(log_path, "w") as log:
                variables = dict(env or {})
                variables.update((host_env or {}).get(host.index, {}))
                process = self.popen(host.index, argv, env=variables, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=cwd)
            runs.append(HostRun(host, process, log_path))
        deadline = time.monotonic() + timeout
        failed = timed_out = False
        while True:
            for run in runs:
                if run.returncode is None:
                    run.returncode = run.process.poll()
            pending = [run for run in runs if run.returncode is None]
            if not pending:
                break
            if not failed and any(run.returncode not in (None, 0) for run in runs):
                failed = True
                deadline = min(deadline, time.monotonic() + failure_grace)
            if time.monotonic() > deadline:
                timed_out = not failed
                for run in pending:
                    try:
                        os.killpg(run.process.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    run.process.wait()
                    run.returncode = run.process.returncode
                _kill([pid for host in self.hosts for pid in _namespace_pids(host.namespace)])
                break
            time.sleep(0.1)
        return ClusterRun([run.returncode for run in runs], [run.output for run in runs], timed_out)

    def _check_running(self):
        if not self.started or self.closed:
            raise ClusterError(f"emulated cluster {self.run_id} is not running (start() it, or it was closed)")

    # -- links --

    def link_counters(self, index):
        """LinkCounters of host ``index``'s link (bytes since the cluster started)."""
        self._check_running()
        host = self.hosts[index]
        received = parse_tc_sent(_run(["tc", "-s", "qdisc", "show", "dev", host.veth]).stdout)[0]
        sent = parse_tc_sent(_run(["ip", "netns", "exec", host.namespace, "tc", "-s", "qdisc", "show", "dev",
                                   INTERFACE]).stdout)[0]
        return LinkCounters(sent=sent, received=received)

    def measure_rate(self, source, destination, megabytes=4.0, timeout=60):
        """The measured rate from host ``source`` to host ``destination`` in bits/s of payload: a
        timed TCP transfer of ``megabytes`` MB, timed by the receiver from the first byte to the
        last (the payload rate is a few % under the tbf rate, which counts frame headers)."""
        self._check_running()
        size = int(megabytes * 1e6)
        port = 20000 + (os.getpid() + self.run * 7 + destination) % 20000
        receiver = self.popen(destination, [sys.executable, "-c", _RECEIVER, self.hosts[destination].address,
                                            str(port), str(size)], stdout=subprocess.PIPE, text=True)
        sender = self.run_on(source, [sys.executable, "-c", _SENDER, self.hosts[destination].address, str(port),
                                      str(size)], timeout=timeout)
        output, _ = receiver.communicate(timeout=timeout)
        if sender.returncode != 0 or receiver.returncode != 0:
            raise ClusterError(f"rate probe {source} -> {destination} failed: {sender.stderr.strip()} {output}")
        received, seconds = output.split()
        return int(received) * 8 / float(seconds)


# The probe's two ends: the receiver listens first and prints "<bytes> <seconds>".
_RECEIVER = """
import socket, sys, time
address, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
connection, _ = server.accept()
data = connection.recv(1 << 16)
start, received = time.perf_counter(), 0
while data:
    received += len(data)
    data = connection.recv(1 << 16)
seconds = time.perf_counter() - start
print(received, seconds)
"""
_SENDER = """
import socket, sys, time
address, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for attempt in range(100):
    try:
        connection = socket.create_connection((address, port))
        break
    except OSError:
        time.sleep(0.05)
connection.sendall(bytes(size))
connection.close()
"""


# -- teardown on exit and signals ---------------------------------------------------------------


def close_all():
    """Tear down every cluster this process has open."""
    with _lock:
        clusters = list(_open_clusters)
    for cluster in clusters:
        cluster.close()


def _on_signal(signum, frame):
    close_all()
    previous = _saved_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(cluster):
    with _lock:
        first = not _open_clusters
        _open_clusters.append(cluster)
    if first and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            _saved_handlers[signum] = signal.signal(signum, _on_signal)


def _unregister(cluster):
    with _lock:
        if cluster in _open_clusters:
            _open_clusters.remove(cluster)
        last = not _open_clusters
    if last and _saved_handlers and threading.current_thread() is threading.main_thread():
        for signum, handler in list(_saved_handlers.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, handler)
        _saved_handlers.clear()


atexit.register(close_all)


# -- command line -------------------------------------------------------------------------------


def _per_host(text, count, name, cast=float):
    """A comma-separated list with one value per host (one value: every host)."""
    if text is None:
        return [None] * count
    values = [cast(v) for v in text.split(",")]
    if len(values) == 1:
        values *= count
    if len(values) != count:
        raise SystemExit(f"--{name}: {len(values)} values for {count} hosts (give one, or one per host)")
    return values


def host_specs_from_args(args):
    ranks = [int(r) for r in args.ranks.split(",")]
    count = len(ranks)
    rates = _per_host(args.rate_mbit, count, "rate-mbit")
    cpus = _per_host(args.cpus, count, "cpus")
    memory = _per_host(args.memory_gb, count, "memory-gb")
    try:
        return [HostSpec(r, rate, cpu, mem) for r, rate, cpu, mem in zip(ranks, rates, cpus, memory)]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,2", help="ranks per host, comma-separated (default 2,2)")
    parser.add_argument("--rate-mbit", help="link rate of each host in Mbit/s (one value, or one per host)")
    parser.add_argument("--cpus", help="CPU quota of each host (one value, or one per host)")
    parser.add_argument("--memory-gb", help="memory limit of each host in GiB (one value, or one per host)")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed",
                        help="the launcher every host runs (torchrun: equal ranks per host)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--measure", action="store_true", help="measure each host's rate to host 0, then exit")
    parser.add_argument("--cleanup", action="store_true", help="remove stale runs of killed processes, then exit")
    parser.add_argument("script", nargs="?", help="training script, run on every host through the deepspeed launcher")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cleanup:
        reason = available()
        if reason:
            raise SystemExit(reason)
        for name in remove_stale():
            print(f"removed {name}")
        return 0
    specs = host_specs_from_args(args)
    if not args.measure and not args.script:
        parser.error("give a training script (or --measure / --cleanup)")
    with EmulatedCluster(specs) as cluster:
        for host in cluster.hosts:
            spec = host.spec
            print(f"host {host.index}: {host.namespace} {host.address} ranks {cluster.ranks_of(host.index)}, "
                  f"link {f'{spec.rate_mbit:g} Mbit/s' if spec.rate_mbit else 'unshaped'}, "
                  f"cpus {f'{spec.cpus:g}' if spec.cpus else 'unlimited'}, "
                  f"memory {f'{spec.memory_gb:g} GiB' if spec.memory_gb else 'unlimited'}", flush=True)
        if args.measure:
            for index in range(1, len(cluster.hosts)):
                rate = cluster.measure_rate(index, 0)
                print(f"host {index} -> host 0: {rate / 1e6:.1f} Mbit/s measured", flush=True)
            return 0
        before = [cluster.link_counters(k) for k in range(len(cluster.hosts))]
        result = cluster.launch_deepspeed(args.script, args.script_args, timeout=args.timeout,
                                          master_port=args.master_port, launcher=args.launcher)
        for index, output in enumerate(result.outputs):
            print(f"===== host {index} (exit {result.returncodes[index]}) =====\n{output}", flush=True)
        for index in range(len(cluster.hosts)):
            moved = cluster.link_counters(index) - before[index]
            print(f"host {index} link: {moved.sent} bytes sent, {moved.received} bytes received")
        return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
