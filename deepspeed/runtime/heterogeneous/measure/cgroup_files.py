# SPDX-License-Identifier: Apache-2.0
"""Reading cgroups: where the cpu and memory controllers are mounted, this process's cgroup in
them, and the memory limit it runs under (set from outside by a job scheduler or a container, or
by the fork's emulation). Read-only: creating and removing cgroups is ``emulation/cgroups.py``'s."""

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
