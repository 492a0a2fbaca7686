# SPDX-License-Identifier: Apache-2.0
"""An emulated mixed cluster on identical devices, for tests, benchmarks and demos.

``heterogeneous_config.emulation.speeds[r]`` slows data-parallel rank r to that fraction of its
device's speed, by one of two means:

- ``cgroup``: the rank moves itself into a CPU-quota cgroup (v2 ``cpu.max`` or v1
  ``cpu.cfs_quota_us``) that grants ``speed`` of the CPU time it would otherwise use. Everything
  the process does is throttled (compute, optimizer, communication threads), like a slower host.
  Needs root and a writable cpu controller; the cgroup is removed when the process exits.
- ``dilation``: after each forward+backward, the rank sleeps ``(1/speed - 1)`` times the compute
  time it measured. Portable, but only compute is slowed.

``auto`` picks cgroup where the machine allows it, else dilation. The balancing code never reads
these settings: it sees only the (slowed) times it measures.
"""

import atexit
import os
import time
from pathlib import Path

from deepspeed.utils import logger

CGROUP_PREFIX = "deepspeed-hetero-"
# A short period keeps the throttling smooth at the scale of one micro-step (tens of ms): with the
# default 100 ms a rank would run at full speed for its quota, then stall for the rest.
CFS_PERIOD_US = 10_000


def _cgroup_v2_root():
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "cpu" in controllers.read_text().split():
            return root
    return None


def _cgroup_v1_root():
    root = Path("/sys/fs/cgroup/cpu")
    return root if (root / "cpu.cfs_quota_us").is_file() else None


def _remove_stale_cgroups(root):
    """Cgroups of runs that were killed (SIGKILL skips atexit): empty and their pid is gone."""
    for path in root.glob(CGROUP_PREFIX + "*"):
        pid = path.name[len(CGROUP_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                path.rmdir()
            except OSError:
                pass


class CpuQuotaCgroup:
    """This process in a cgroup limited to ``cpu_share`` CPUs; ``close()`` undoes it."""

    def __init__(self, cpu_share):
        self.root = _cgroup_v2_root() or _cgroup_v1_root()
        if self.root is None:
            raise OSError("no writable cgroup cpu controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us)")
        _remove_stale_cgroups(self.root)
        self.path = self.root / f"{CGROUP_PREFIX}{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        try:
            self.set_share(cpu_share)
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.path.rmdir()
            raise
        atexit.register(self.close)

    def set_share(self, cpu_share):
        """Grant ``cpu_share`` CPUs from now on."""
        quota = max(1000, int(cpu_share * CFS_PERIOD_US))
        if (self.path / "cpu.max").exists():
            (self.path / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def close(self):
        if self.path is None:
            return
        try:
            (self.root / "cgroup.procs").write_text(str(os.getpid()))
            self.path.rmdir()
        except OSError:
            pass  # already gone, or another thread still inside: the next run removes it
        self.path = None


class Emulator:
    """Slows this rank to ``speed``; ``mode`` is the means in force ('cgroup', 'dilation' or 'none')."""

    def __init__(self, speed, mode="auto", threads=None):
        import torch
        self.speed = 1.0
        self.mode = "none"
        self._requested = mode
        self._threads = threads or torch.get_num_threads()
        self._cgroup = None
        self.set_speed(speed)

    def set_speed(self, speed):
        """Run at ``speed`` from now on (the emulated device slowed down or recovered)."""
        self.speed = float(speed)
        if self._cgroup is not None:
            self._cgroup.set_share(self.speed * self._threads)
            return
        if self.speed >= 1.0 or self.mode == "dilation":
            return
        if self._requested in ("auto", "cgroup"):
            try:
                self._cgroup = CpuQuotaCgroup(self.speed * self._threads)
                self.mode = "cgroup"
                return
            except OSError as exc:
                if self._requested == "cgroup":
                    raise RuntimeError(f"heterogeneous_config.emulation.mode 'cgroup' is not possible here ({exc}); "
                                       "use 'dilation' or 'auto'") from exc
        self.mode = "dilation"

    def after_compute(self, seconds):
        """Called after each forward+backward with its measured duration."""
        if self.mode == "dilation" and seconds > 0:
            time.sleep(seconds * (1.0 / self.speed - 1.0))

    def close(self):
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None


def start_emulation(emulation, rank):
    """The Emulator of data-parallel ``rank`` for an EmulationConfig (None: no emulation)."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule):
        return None
    emulator = Emulator(emulation.speeds[rank] if emulation.speeds else 1.0, emulation.mode)
    logger.info(f"deepspeed-hetero emulation: rank {rank} runs at speed {emulator.speed} by {emulator.mode}")
    return emulator


def scheduled_speed(emulation, rank, step):
    """The speed ``emulation.speed_schedule`` gives ``rank`` from optimizer step ``step`` on, or None."""
    for change in (emulation.speed_schedule or []) if emulation is not None else []:
        if change.step == step:
            return change.speeds[rank]
    return None
