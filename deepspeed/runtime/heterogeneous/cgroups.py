# SPDX-License-Identifier: Apache-2.0
"""Linux cgroups of one process: the mechanics behind an emulated rank's speed and memory
(``emulation.py``), and the memory limit a process already runs under (``devices.py``).

A rank that emulates a device moves itself into a cgroup of its own, ``deepspeed-hetero-<pid>``
(``-rank<r>`` appended when it knows its rank, so that a report after its death can name it):

- v1 (one mount per controller, ``/sys/fs/cgroup/<controller>``): the cgroup is created under the
  process's current cgroup, so every limit set above it (a job scheduler's, a container's) still
  applies; the cpu and the memory cgroup are two directories of the same name.
- v2 (one hierarchy, ``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``): a process is in exactly one
  cgroup, so its cpu and memory settings share one directory. A non-root cgroup that holds
  processes cannot hand controllers to children, so the directory goes under the nearest
  ancestor-or-self that already does (in practice a sibling of the process's leaf), or the root.

Creating a cgroup needs root (or a delegated subtree). It is removed when the process exits
(atexit) or closes it; ``SIGKILL`` skips atexit, so every start first removes the cgroups of
this name whose owning process is gone. A cgroup killed by its memory limit stays until then,
which lets ``oom_kill_report`` tell why the process died (the launcher asks it).
"""

import atexit
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
PREFIX = "deepspeed-hetero-"
# v1 writes "no limit" as the largest page-aligned long; anything this large is no limit.
UNLIMITED_V1 = 2**60


@dataclass(frozen=True)
class Hierarchy:
    """Where ``controller`` is mounted, and this process's cgroup in it."""

    controller: str
    version: int
    mount: Path
    current: str
    """This process's cgroup, relative to the mount ('/' is its root)."""

    @property
    def current_dir(self):
        path = self.mount / self.current.lstrip("/")
        # Without a cgroup namespace a container sees its host's path but has its own cgroup mounted.
        return path if path.is_dir() else self.mount


def proc_cgroup_path(text, controller=None):
    """This process's cgroup in a ``/proc/<pid>/cgroup`` text: the v1 line listing ``controller``, or
    the v2 line ``0::<path>`` when ``controller`` is None. None when there is no such line."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if controller is None and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if controller is not None and controller in parts[1].split(","):
            return parts[2]
    return None


def find_hierarchy(controller, root=CGROUP_FS, proc_cgroup=None):
    """The Hierarchy holding ``controller`` ('cpu' or 'memory'), or None.

    A controller is bound to one hierarchy at a time: v2 where its ``cgroup.controllers`` lists it,
    else its v1 mount. ``proc_cgroup`` is the text of ``/proc/self/cgroup`` (read when None).
    """
    root = Path(root)
    text = Path("/proc/self/cgroup").read_text() if proc_cgroup is None else proc_cgroup
    for mount in (root, root / "unified"):
        controllers = mount / "cgroup.controllers"
        if controllers.is_file() and controller in controllers.read_text().split():
            return Hierarchy(controller, 2, mount, proc_cgroup_path(text) or "/")
    mount = root / controller
    if (mount / "cgroup.procs").is_file():
        return Hierarchy(controller, 1, mount, proc_cgroup_path(text, controller) or "/")
    return None


def placement(hierarchy):
    """The directory a new cgroup of this process goes under (see the module's docstring)."""
    current = hierarchy.current_dir
    if hierarchy.version == 1:
        return current
    path = current
    while path != hierarchy.mount:
        subtree = path / "cgroup.subtree_control"
        if path != current and subtree.is_file() and hierarchy.controller in subtree.read_text().split():
            return path
        path = path.parent
    return hierarchy.mount


def cgroup_name(pid, label=""):
    return f"{PREFIX}{pid}" + (f"-{label}" if label else "")


def owner_pid(name):
    """The pid in a ``deepspeed-hetero-<pid>[-label]`` name, or None for any other name."""
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX):].split("-")[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid):
    return Path(f"/proc/{pid}").exists()


def stale_cgroups(parent, alive=_alive):
    """The cgroups under ``parent`` left by processes that are gone (SIGKILL skips atexit)."""
    found = []
    for path in sorted(Path(parent).glob(PREFIX + "*")):
        pid = owner_pid(path.name)
        if pid is not None and path.is_dir() and not alive(pid):
            found.append(path)
    return found


def remove_stale_cgroups(parent, alive=_alive):
    """Remove the stale cgroups under ``parent``; returns those removed. One that still holds a
    process (a data-loader worker that outlived its rank) cannot be removed and is kept."""
    removed = []
    for path in stale_cgroups(parent, alive):
        try:
            path.rmdir()
            removed.append(path)
        except OSError:
            pass
    return removed


def _enable_controller(parent, controller, hierarchy):
    """v2: let ``parent``'s children use ``controller`` (a no-op when they already may)."""
    if hierarchy.version != 2:
        return
    subtree = parent / "cgroup.subtree_control"
    if controller not in subtree.read_text().split():
        subtree.write_text(f"+{controller}")


class ProcessCgroup:
    """This process's own cgroup in one hierarchy; one per hierarchy (cpu and memory share it on
    v2), counted by its users: the last ``release()`` moves the process back and removes it."""

    _open = {}  # hierarchy mount -> ProcessCgroup
    _atexit = False

    @classmethod
    def acquire(cls, hierarchy, label=""):
        """The process's cgroup in ``hierarchy``, created (not yet entered) or shared."""
        cgroup = cls._open.get(hierarchy.mount)
        if cgroup is None:
            cgroup = cls(hierarchy, label)
        else:
            _enable_controller(cgroup.path.parent, hierarchy.controller, hierarchy)
        cgroup.users += 1
        return cgroup

    def __init__(self, hierarchy, label):
        self.origin = hierarchy.current_dir
        parent = placement(hierarchy)
        _enable_controller(parent, hierarchy.controller, hierarchy)
        remove_stale_cgroups(parent)
        self.path = parent / cgroup_name(os.getpid(), label)
        self.path.mkdir(exist_ok=True)
        self.users = 0
        self.entered = False
        ProcessCgroup._open[hierarchy.mount] = self
        if not ProcessCgroup._atexit:
            atexit.register(ProcessCgroup.close_all)
            ProcessCgroup._atexit = True
        self._mount = hierarchy.mount

    def write(self, name, value):
        (self.path / name).write_text(str(value))

    def has(self, name):
        return (self.path / name).exists()

    def enter(self):
        """Move the whole process (every thread) into the cgroup."""
        if not self.entered:
            self.write("cgroup.procs", os.getpid())
            self.entered = True

    def release(self):
        self.users -= 1
        if self.users <= 0:
            self._remove()

    def _remove(self):
        if ProcessCgroup._open.get(self._mount) is self:
            del ProcessCgroup._open[self._mount]
        try:
            if self.entered:
                (self.origin / "cgroup.procs").write_text(str(os.getpid()))
            self.path.rmdir()
        except OSError:
            pass  # a child process still inside: the next start removes it once this process is gone

    @classmethod
    def close_all(cls):
        for cgroup in list(cls._open.values()):
            cgroup._remove()


# -- memory limits ----------------------------------------------------------------------------


def parse_memory_limit(text):
    """Bytes of a v1 ``memory.limit_in_bytes`` or v2 ``memory.max`` value; None for no limit."""
    value = text.strip()
    if value in ("", "max"):
        return None
    number = int(value)
    return None if number >= UNLIMITED_V1 else number


def memory_limit_file(version):
    return "memory.max" if version == 2 else "memory.limit_in_bytes"


def memory_limit(root=CGROUP_FS, proc_cgroup=None):
    """The memory limit this process runs under from outside: the smallest one set on its memory
    cgroup or any ancestor up to the mount (a job scheduler's, a container's, one set by hand), in
    bytes; None when there is none or no memory controller is mounted. The fork's own emulation
    cgroups do not count: their limit is ``emulation.memory_gb``, which the plan already knows."""
    hierarchy = find_hierarchy("memory", root, proc_cgroup)
    if hierarchy is None:
        return None
    limits = []
    path = hierarchy.current_dir
    while True:
        limit_file = path / memory_limit_file(hierarchy.version)
        if owner_pid(path.name) is None and limit_file.is_file():
            limit = parse_memory_limit(limit_file.read_text())
            if limit is not None:
                limits.append(limit)
        if path == hierarchy.mount:
            break
        path = path.parent
    return min(limits) if limits else None


def oom_kills(path, version):
    """How many processes the kernel killed in the memory cgroup ``path`` for its limit (v2
    ``memory.events``, v1 ``memory.oom_control``: both have an ``oom_kill`` line)."""
    events = path / ("memory.events" if version == 2 else "memory.oom_control")
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def oom_kill_report(pid, root=CGROUP_FS, proc_cgroup=None, remove=True):
    """Why process ``pid`` (a rank this process launched, now dead) died, when its emulated memory
    limit killed it: a message naming its rank and limit, else None. Its cgroup is stale by now and
    is removed (``remove``). The rank's cgroup was created next to where this process's children
    start, so the caller must be in the cgroup the rank was started in (a launcher is)."""
    hierarchy = find_hierarchy("memory", root, proc_cgroup)
    if hierarchy is None:
        return None
    message = None
    for path in Path(placement(hierarchy)).glob(f"{cgroup_name(pid)}*"):
        if owner_pid(path.name) != pid:
            continue
        if message is None and oom_kills(path, hierarchy.version) > 0:
            label = path.name[len(cgroup_name(pid)):].lstrip("-")
            limit_file = path / memory_limit_file(hierarchy.version)
            limit = parse_memory_limit(limit_file.read_text()) if limit_file.is_file() else None
            from .emulation import describe_memory_limit
            message = (f"deepspeed-hetero emulation: {label.replace('rank', 'data-parallel rank ') or 'a rank'} "
                       f"(pid {pid}) was killed by the kernel because it exceeded its emulated memory: "
                       f"{describe_memory_limit(limit)}")
        if remove:
            try:
                path.rmdir()
            except OSError:
                pass
    return message


def remove_stale_cgroups_everywhere():
    """Remove the stale cgroups of this process's children (cpu and memory hierarchies)."""
    for controller in ("cpu", "memory"):
        try:
            hierarchy = find_hierarchy(controller)
            if hierarchy is not None:
                remove_stale_cgroups(placement(hierarchy))
        except OSError:
            pass


def ranks_failed(processes, log):
    """The per-node launcher saw one of its rank ``processes`` (``subprocess.Popen``) fail: ``log``
    which ranks their emulated memory limit killed (SIGKILL; the first failure the launcher sees
    may be a peer's, whose collective broke when that rank died), and remove the cgroups its ranks
    leave when the launcher exits (the survivors, terminated by it, skip their atexit too)."""
    for process in processes:
        if process.poll() in (-9, 128 + 9):
            try:
                message = oom_kill_report(process.pid)
            except (OSError, ValueError):
                message = None
            if message:
                log(message)
    atexit.register(remove_stale_cgroups_everywhere)
