# SPDX-License-Identifier: Apache-2.0
"""Linux cgroups of one process: the mechanics behind an emulated rank's speed and memory
(``emulator.py``). Reading cgroups (where they are mounted, the memory limit a process already
runs under) is ``measure/cgroup_files.py``'s.

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
from pathlib import Path

from ..measure.cgroup_files import (CGROUP_FS, PREFIX, UNLIMITED_V1, Hierarchy, cgroup_name, find_hierarchy,
                                    memory_limit, memory_limit_file, owner_pid, parse_memory_limit, placement,
                                    proc_cgroup_path)


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


# What the host process itself allocates after joining its memory cgroup and a device would not
# hold: Python objects, gloo's buffers, allocator slack (measured: 10-70 MiB for a small model).
HOST_ALLOWANCE_BYTES = 256 * 2**20


GIB = 2.0**30


def memory_limit_bytes(memory_gb):
    """The cgroup limit that emulates ``memory_gb`` GiB of device memory (see HOST_ALLOWANCE_BYTES)."""
    return int(memory_gb * GIB) + HOST_ALLOWANCE_BYTES


def describe_memory_limit(limit_bytes):
    """A cgroup limit in the user's terms: the emulated capacity plus the host allowance."""
    if limit_bytes is None:
        return "no limit"
    # The kernel rounds a limit down to whole pages: three digits say what the user wrote.
    return (f"a cgroup limit of {limit_bytes / GIB:.3g} GiB = heterogeneous_config.emulation.memory_gb "
            f"{(limit_bytes - HOST_ALLOWANCE_BYTES) / GIB:.3g} + {HOST_ALLOWANCE_BYTES / GIB:.3g} GiB for the host "
            "process, counted from the engine's start")
