# SPDX-License-Identifier: Apache-2.0
"""An emulated mixed cluster on identical devices, for tests, benchmarks and demos.

``heterogeneous_config.emulation.speeds[r]`` slows data-parallel rank r to that fraction of its
device's speed, by one of two means:

- ``cgroup``: the rank moves itself into a CPU-quota cgroup (v2 ``cpu.max`` or v1
  ``cpu.cfs_quota_us``) that grants ``speed`` of the CPU time it would otherwise use. Everything
  the process does is throttled (compute, optimizer, communication threads), like a slower host.
  Needs root and a writable cpu controller; the cgroup is removed when the process exits.
- ``dilation``: the rank sleeps ``(1/speed - 1)`` times the forward+backward compute it measured,
  each part where it ends: before every collective inside the micro-step (the compute since the
  last one) and at the micro-step's end (the rest). A peer then waits at each collective as it
  would for a slower device; one sleep at the end would let the collectives inside backward
  (ZeRO-2 buckets, ZeRO-3's reduce-scatter and gathers) run at full speed and the peers wait
  twice, at them and after. Portable, but only compute is slowed. ``emulation.dilation_clock``
  says what is stretched: ``elapsed`` (the default), the compute's elapsed time, so that a slowed
  rank keeps its ratio to a rank at full speed that waits for the cores as much on a busy machine;
  ``own``, the rank's own compute only, the time its thread waited for a core other threads or
  processes held (Linux schedstat; outside collectives, as the compute is) absorbed into the sleep
  (``dilation_sleep``). ``own`` is for clusters whose every rank is dilated to stand for devices
  that leave the host's cores free: there ranks that share cores wait in bursts (their forwards
  start together), and ``elapsed`` stretches each burst by ``1/speed``: 4 ranks at speed 0.25 on 2
  cores reached their first gradient bucket 65-300 ms apart in a 1.2 s step, 21-61 ms with ``own``.

``auto`` picks cgroup where the machine allows it, else dilation. A quota only caps a rank: where
other processes already hold the cores it slows the rank less than asked (measured on 2 cores
beside two busy loops: 0.82-0.87 for an asked 0.4), so at start-up every rank runs the same short
workload at once and the speeds achieved are compared with the asked ones (``achieved_speeds``,
``speeds_hold``); under ``auto`` the quota ranks fall back to dilation where they miss by more
than 15% (``limits.EmulatedLimits.check_speeds``). The balancing code never reads these settings:
it sees only the (slowed) times it measures.

``emulation.memory_gb[r]`` is always enforced by accounting (``limits.py``: predicted
model state + measured activations against the capacity). Where ``mode`` lets the emulation use
cgroups ('auto' where the machine allows it, 'cgroup' always), the rank also joins a memory cgroup
at the engine's start (``start_memory_limit``): beyond ``memory_gb`` GiB plus a fixed allowance for
the host process, counted from that moment, the kernel kills it as a device would fail to
allocate, and the launcher reports which rank died and why (``cgroups.oom_kill_report``).
The cgroup mechanics (placement, removal, stale cgroups of killed runs) are in ``cgroups.py``.
"""

import time

from deepspeed.utils import logger

from ..measure import comm_clock
from .cgroups import (GIB, HOST_ALLOWANCE_BYTES, ProcessCgroup, describe_memory_limit, find_hierarchy,
                      memory_limit_bytes)


def _own_mark(clock):
    """Where an unstretched stretch of compute begins: the time, the time in collectives, and for the
    ``own`` clock the waits for a core in all and inside collectives."""
    if clock != "own":
        return time.perf_counter(), comm_clock.seconds_in_collectives(), 0.0, 0.0
    return (time.perf_counter(), comm_clock.seconds_in_collectives(), comm_clock.run_queue_seconds() or 0.0,
            comm_clock.run_queue_in_collectives())


def dilation_sleep(speed, compute, waiting=0.0):
    """Seconds to sleep after ``compute`` seconds of compute so that it lasts as long as on a device
    ``speed`` times as fast: ``compute * (1/speed - 1)``. With ``waiting`` (``dilation_clock: own``:
    the part of ``compute`` spent waiting for a core other threads or processes held), only the rank's own part
    is stretched, to ``(compute - waiting) / speed`` in all, less the ``compute`` already past
    (nothing where the wait alone took longer)."""
    device = compute - min(max(waiting, 0.0), compute)
    return max(0.0, device / speed - compute)

# A short period keeps the throttling smooth at the scale of one micro-step (tens of ms): with the
# default 100 ms a rank would run at full speed for its quota, then stall for the rest.
CFS_PERIOD_US = 10_000


def _controller(controller, needed):
    hierarchy = find_hierarchy(controller)
    if hierarchy is None:
        raise OSError(f"no cgroup {controller} controller is mounted (cgroup v2 or v1 /sys/fs/cgroup/{controller}); "
                      f"needed: {needed}")
    return hierarchy


class CpuQuotaCgroup:
    """This process in a cgroup limited to ``cpu_share`` CPUs; ``close()`` undoes it."""

    def __init__(self, cpu_share, label=""):
        hierarchy = _controller("cpu", "v2 cpu.max or v1 cpu.cfs_quota_us")
        self.cgroup = ProcessCgroup.acquire(hierarchy, label)
        try:
            self.set_share(cpu_share)
            self.cgroup.enter()
        except OSError:
            self.close()
            raise

    @property
    def path(self):
        return self.cgroup.path if self.cgroup is not None else None

    def set_share(self, cpu_share):
        """Grant ``cpu_share`` CPUs from now on."""
        quota = max(1000, int(cpu_share * CFS_PERIOD_US))
        if self.cgroup.has("cpu.max"):
            self.cgroup.write("cpu.max", f"{quota} {CFS_PERIOD_US}")
        else:
            self.cgroup.write("cpu.cfs_period_us", CFS_PERIOD_US)
            self.cgroup.write("cpu.cfs_quota_us", quota)

    def close(self):
        if self.cgroup is not None:
            self.cgroup.release()
            self.cgroup = None


class MemoryLimitCgroup:
    """This process in a cgroup that lets it charge ``limit_bytes`` from the moment it joins;
    beyond that the kernel kills it (SIGKILL), as a device raises out-of-memory. ``close()`` undoes it.

    Charges stay where they were made: what the process held before joining (the interpreter,
    torch, a model built before ``deepspeed.initialize``) is charged to its former cgroup and does
    not count. Swap is closed (v2 ``memory.swap.max`` 0; v1 ``memory.memsw.limit_in_bytes`` equal to
    the limit where swap accounting is on, and ``memory.swappiness`` 0), so that a rank over its
    limit dies instead of swapping.
    """

    def __init__(self, limit_bytes, label=""):
        hierarchy = _controller("memory", "v2 memory.max or v1 memory.limit_in_bytes")
        self.cgroup = ProcessCgroup.acquire(hierarchy, label)
        try:
            self.set_limit(limit_bytes)
            self.cgroup.enter()
        except OSError:
            self.close()
            raise

    def set_limit(self, limit_bytes):
        """Allow ``limit_bytes`` from now on (an OSError when the process already holds more)."""
        self.limit_bytes = int(limit_bytes)
        if self.cgroup.has("memory.max"):
            self.cgroup.write("memory.max", self.limit_bytes)
            if self.cgroup.has("memory.swap.max"):
                self.cgroup.write("memory.swap.max", 0)
            return
        # v1: memsw (memory + swap) may not be below the memory limit, so it follows it.
        if self.cgroup.has("memory.memsw.limit_in_bytes"):
            old = int((self.cgroup.path / "memory.limit_in_bytes").read_text())
            order = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
            for name in (order if self.limit_bytes <= old else order[::-1]):
                self.cgroup.write(name, self.limit_bytes)
        else:
            self.cgroup.write("memory.limit_in_bytes", self.limit_bytes)
        if self.cgroup.has("memory.swappiness"):
            self.cgroup.write("memory.swappiness", 0)

    @property
    def path(self):
        return self.cgroup.path if self.cgroup is not None else None

    def close(self):
        if self.cgroup is not None:
            self.cgroup.release()
            self.cgroup = None


_memory_cgroup = None  # this process's MemoryLimitCgroup (a process is one rank)


def start_memory_limit(emulation, rank):
    """Put this process under rank ``rank``'s emulated memory (``emulation.memory_gb``) by a memory
    cgroup; returns it, or None where memory is emulated by accounting alone.

    ``mode`` decides whether the emulation may use cgroups at all: 'dilation' never does (speed by
    sleeping, memory by the accounting check); 'auto' uses a memory cgroup where the machine
    allows it; 'cgroup' requires one. Process-wide: a later engine's limit replaces an earlier one's.
    """
    sizes = emulation.memory_gb if emulation is not None else None
    if not sizes or rank >= len(sizes) or emulation.mode == "dilation":
        return None
    global _memory_cgroup
    limit = memory_limit_bytes(sizes[rank])
    current = _memory_cgroup if _memory_cgroup is not None and _memory_cgroup.cgroup is not None else None
    if current is not None and current.limit_bytes == limit:
        return current  # the engine's start joined it; the runtime asks again as it is created
    try:
        if current is not None:
            current.set_limit(limit)  # a later engine of this process, with its own config
        else:
            _memory_cgroup = MemoryLimitCgroup(limit, label=f"rank{rank}")
    except OSError as exc:
        if emulation.mode == "cgroup":
            raise RuntimeError(f"heterogeneous_config.emulation.mode 'cgroup' cannot limit rank {rank}'s memory here "
                               f"({exc}; a memory cgroup needs root or a delegated cgroup); use 'dilation' or "
                               "'auto', which enforce memory_gb by accounting alone") from exc
        logger.info(f"deepspeed-hetero emulation: rank {rank}'s memory_gb is enforced by accounting only ({exc})")
        return None
    shown = describe_memory_limit(_memory_cgroup.limit_bytes)
    logger.info(f"deepspeed-hetero emulation: rank {rank} runs under {shown}")
    return _memory_cgroup


SPEED_TOLERANCE = 0.15
"""How far (relative) an emulated rank's measured speed may sit from the asked one."""


def workload_seconds(iterations=120, size=256, rounds=3):
    """Seconds this process takes for a fixed compute workload on its accelerator (matrix products
    at the threads training uses), after a short warm-up: what a CPU quota or a busy core slows."""
    import torch
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    device = accelerator.current_device_name()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device)
    b = (torch.randn(size, size, generator=generator) / size**0.5).to(device)
    for _ in range(10):
        a = torch.tanh(a @ b)
    accelerator.synchronize()
    began = time.perf_counter()
    for _ in range(iterations * rounds):
        a = torch.tanh(a @ b)
    accelerator.synchronize()
    return time.perf_counter() - began


def achieved_speeds(asked, seconds):
    """Per rank, the speed it ran the same workload at, relative to an unthrottled rank: the ranks
    asked to run at 1.0 are the reference (their mean time), else the fastest asked rank, taken to
    run at its asked speed. ``asked`` and ``seconds`` are per emulated rank."""
    full = [t for s, t in zip(asked, seconds) if s >= 1.0]
    if full:
        reference = sum(full) / len(full)
    else:
        fastest = max(range(len(asked)), key=lambda r: (asked[r], -r))
        reference = seconds[fastest] * asked[fastest]
    return [round(reference / t, 3) if t > 0 else float("inf") for t in seconds]


def speeds_hold(asked, achieved, tolerance=SPEED_TOLERANCE):
    """Whether every rank's achieved speed is within ``tolerance`` (relative) of the asked one."""
    return all(abs(a - s) <= tolerance * s for s, a in zip(asked, achieved))


class Emulator:
    """Slows this rank to ``speed``; ``mode`` is the means in force ('cgroup', 'dilation' or 'none')."""

    def __init__(self, speed, mode="auto", threads=None, label="", clock="elapsed"):
        import torch
        self._label = label
        if clock not in ("elapsed", "own"):
            raise ValueError(f"heterogeneous_config.emulation.dilation_clock {clock!r} is not allowed; use \"elapsed\" "
                             "or \"own\"")
        if clock == "own" and comm_clock.run_queue_seconds() is None:
            logger.warning("deepspeed-hetero emulation: dilation_clock 'own' needs the kernel's run-queue time "
                           "(/proc/thread-self/schedstat), which this machine does not give; dilation stretches "
                           "the elapsed time")
            clock = "elapsed"
        self.clock = clock  # emulation.dilation_clock (dilation_sleep)
        if clock == "own":
            comm_clock.track_run_queue(True)
        self.speed = 1.0
        self.mode = "none"
        self._requested = mode
        self._threads = threads or torch.get_num_threads()
        self._cgroup = None
        self._since = None  # dilation: _own_mark() where the unstretched compute began
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
                self._cgroup = CpuQuotaCgroup(self.speed * self._threads, self._label)
                self.mode = "cgroup"
                return
            except OSError as exc:
                if self._requested == "cgroup":
                    raise RuntimeError(f"heterogeneous_config.emulation.mode 'cgroup' is not possible here ({exc}); "
                                       "use 'dilation' or 'auto'") from exc
        self.mode = "dilation"

    def use_dilation(self):
        """Slow this rank by dilation from now on, also at later speed changes (a quota that did not
        deliver its speed is left)."""
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None
        self._requested = "dilation"
        self.mode = "dilation" if self.speed < 1.0 else "none"

    def begin_compute(self):
        """A forward+backward starts: dilation stretches its compute from here on."""
        if self.mode != "dilation":
            return
        self._since = _own_mark(self.clock)
        comm_clock.before_collective = self._dilate

    def after_compute(self, seconds=None):
        """A forward+backward ended: stretch its compute since the last collective (``seconds``, the
        whole micro-step's, is used only when ``begin_compute`` was not called)."""
        if self.mode != "dilation":
            return
        if self._since is None:
            if seconds and seconds > 0:
                time.sleep(seconds * (1.0 / self.speed - 1.0))
            return
        self._dilate()
        self._since = None
        if comm_clock.before_collective == self._dilate:
            comm_clock.before_collective = None

    def _dilate(self):
        """Stretch the compute since the last mark (time in collectives left out; ``dilation_sleep``)."""
        if self._since is None:
            return
        began, in_collectives, waited, waited_in_collectives = self._since
        compute = time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives)
        waiting = 0.0
        if self.clock == "own":  # the waits for a core outside collectives, as the compute is
            waiting = ((comm_clock.run_queue_seconds() or 0.0) - waited -
                       (comm_clock.run_queue_in_collectives() - waited_in_collectives))
        slept = dilation_sleep(self.speed, compute, waiting) if compute > 0 else 0.0
        if slept > 0:
            time.sleep(slept)
            comm_clock.seconds_dilated += slept
        self._since = _own_mark(self.clock)

    def close(self):
        if comm_clock.before_collective == self._dilate:
            comm_clock.before_collective = None
        if self.clock == "own":
            comm_clock.track_run_queue(False)
        self._since = None
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None


def start_emulation(emulation, rank):
    """The Emulator of data-parallel ``rank`` for an EmulationConfig (None: no emulation)."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule):
        return None
    emulator = Emulator(emulation.speeds[rank] if emulation.speeds else 1.0, emulation.mode, label=f"rank{rank}",
                        clock=emulation.dilation_clock)
    logger.info(f"deepspeed-hetero emulation: rank {rank} runs at speed {emulator.speed} by {emulator.mode}")
    return emulator


def scheduled_speed(emulation, rank, step):
    """The speed ``emulation.speed_schedule`` gives ``rank`` at optimizer step ``step``: that of the
    latest change at or before it (a run resumed after a change runs at the changed speed), or
    None when no change is due yet."""
    due = [change for change in ((emulation.speed_schedule or []) if emulation is not None else [])
           if change.step <= step]
    return max(due, key=lambda change: change.step).speeds[rank] if due else None
