# SPDX-License-Identifier: Apache-2.0
"""A rank's real memory: what is in use now and the peak it has reached (docs/memory.md).

What counts is what would make the rank fail:
- on an accelerator, what the allocator reserves (``memory_reserved`` / ``max_memory_reserved``:
  a caching allocator fails when it cannot reserve more, whatever is allocated inside);
- on the CPU accelerator, the memory cgroup the process runs in when that cgroup has a limit (the
  kernel kills the process at it; v1 ``memory.usage_in_bytes`` / ``memory.max_usage_in_bytes``,
  v2 ``memory.current`` / ``memory.peak``), else the process's resident memory (``/proc/self/statm``
  now, ``getrusage``'s high-water mark for the peak).

``MemoryMeter.start()`` records what is in use as the engine starts (the baseline the prediction
builds on) and resets the accelerator's peak; ``peak_bytes()`` reads the peak since then. A
cgroup's or a process's peak cannot be reset without touching what its owner measures, so there the
peak counts from the cgroup's (the process's) start, which is never below the engine's own.
"""

import os
import resource
from pathlib import Path

ACCELERATOR, CGROUP, PROCESS, EMULATED = "accelerator", "cgroup", "process", "emulated"


class MemoryMeter:
    """Reads this rank's memory in use and its peak from the source that limits it (module docstring)."""

    def __init__(self, accelerator=None, cgroup_dir=None, source=None):
        if accelerator is None:
            from deepspeed.accelerator import get_accelerator
            accelerator = get_accelerator()
        self._accelerator = accelerator
        on_host = accelerator.device_name() == "cpu"
        self._cgroup = (cgroup_dir if cgroup_dir is not None else limited_memory_cgroup()) if on_host else None
        # EMULATED: a capacity enforced by accounting alone (``emulation.memory_gb`` without a
        # cgroup): an emulated device that is empty at the start and has no peak to read.
        self.source = source or (ACCELERATOR if not on_host else CGROUP if self._cgroup is not None else PROCESS)
        self.baseline_bytes = None
        # Whether the peak is measured against the rank's capacity: not where the capacity is
        # emulated (accounting, or the emulation cgroup, whose limit adds a host allowance).
        self.measures_capacity = self.source in (ACCELERATOR, CGROUP)

    def start(self):
        """Record the baseline (bytes in use now); on an accelerator, reset its peak statistics."""
        if self.source == ACCELERATOR:
            self._accelerator.reset_peak_memory_stats()
        else:
            load_engine_modules()
            fix_host_allocator_threshold()
        self.baseline_bytes = self.current_bytes()
        return self.baseline_bytes

    def current_bytes(self):
        if self.source == EMULATED:
            return 0
        if self.source == ACCELERATOR:
            return int(self._accelerator.memory_reserved())
        if self.source == CGROUP:
            return _read_int(self._cgroup, ("memory.usage_in_bytes", "memory.current"))
        return _resident_bytes()

    def peak_bytes(self):
        """The peak so far (module docstring), or None where it cannot be read."""
        if self.source == EMULATED:
            return None
        if self.source == ACCELERATOR:
            return int(self._accelerator.max_memory_reserved())
        if self.source == CGROUP:
            return _read_int(self._cgroup, ("memory.max_usage_in_bytes", "memory.peak"))
        # ru_maxrss is in KiB on Linux, and updated by the kernel at its own pace.
        return max(int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, _resident_bytes())


def load_engine_modules():
    """Import what the engine imports on first use, so that on the host, where modules live in the
    rank's memory, the baseline holds them: torch's first optimizer imports torch._dynamo (~70 MiB
    on torch 2.13), ZeRO's first gradient reduction the Muon optimizer module (~40 MiB)."""
    import torch._dynamo  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401


# glibc's mallopt parameter and the size from which a block is mapped on its own (and unmapped when freed).
_M_MMAP_THRESHOLD = -3
HOST_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own default, kept fixed


def fix_host_allocator_threshold(threshold=HOST_MMAP_THRESHOLD_BYTES):
    """On the host, make the memory of a freed tensor of ``threshold`` bytes or more go back to the
    kernel, as a device's memory goes back to its pool. glibc maps blocks above a threshold (128 KiB
    to start with) on their own, but raises the threshold to the size of each such block freed (up
    to 32 MiB), so after the first freed parameter-sized tensor the same sizes come from the heap,
    whose freed memory stays with the process: a rank's memory then depends on its allocation
    history (measured: ZeRO-3 held 1.5x the memory of its live tensors, ZeRO-2 1.1x). Setting the
    threshold explicitly, here to glibc's own starting value, turns the adjustment off; tensors
    below it still come from the heap (a model of many tensors under 128 KiB keeps some of the
    excess in ZeRO-3). Returns whether it was set (False off glibc)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def limited_memory_cgroup():
    """This process's memory cgroup directory when the process runs under a memory limit (the
    fork's emulation cgroup, or a limit set from outside on it or an ancestor), else None."""
    try:
        from ..measure.cgroup_files import find_hierarchy, memory_limit, owner_pid
        hierarchy = find_hierarchy("memory")
        if hierarchy is None:
            return None
        current = Path(hierarchy.current_dir)
        return current if owner_pid(current.name) is not None or memory_limit() is not None else None
    except (OSError, ValueError, RuntimeError):
        return None


def _read_int(directory, names):
    for name in names:
        path = Path(directory) / name
        if path.exists():
            try:
                return int(path.read_text().split()[0])
            except (OSError, ValueError):
                return None
    return None


def _resident_bytes():
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
