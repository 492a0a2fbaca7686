# SPDX-License-Identifier: Apache-2.0
"""What an emulated cluster imposes on one rank while training: its speed over the steps
(``emulation.speeds`` / ``speed_schedule``) and its memory (``emulation.memory_gb``).

A real device slows itself and raises its own out-of-memory error; an emulated one needs the
runtime to drive ``emulation.Emulator`` and to compare the predicted bytes with the emulated
capacity. Where cgroups are allowed the memory is also a physical limit: the rank joins a memory
cgroup as the engine starts (``emulation.start_memory_limit``, before the engine allocates its
optimizer state) and the kernel kills it beyond the limit. Nothing here runs when
``heterogeneous_config.emulation`` is not set.
"""

from deepspeed.utils import logger

from ..cluster.agreement import by_replica
from .emulator import (SPEED_TOLERANCE, achieved_speeds, scheduled_speed, speeds_hold, start_emulation,
                       start_memory_limit, workload_seconds)


class EmulatedOutOfMemoryError(RuntimeError):
    """A rank of an emulated cluster needed more than its emulated memory (``emulation.memory_gb``)."""


_speed_owner = None  # the EmulatedLimits whose emulator slows this process


class EmulatedLimits:
    """The emulated speed and memory of data-parallel rank ``rank``.

    Args:
        emulation: ``heterogeneous_config.emulation`` (None: no emulation, every method is a no-op).
        rank: this process's data-parallel rank.
        capacity_bytes: this rank's emulated memory capacity, or None when not enforced.
    """

    def __init__(self, emulation, rank, capacity_bytes=None):
        global _speed_owner
        self.emulation = emulation
        self.rank = rank
        self.capacity_bytes = capacity_bytes if emulation is not None and emulation.memory_gb else None
        # A process is one rank: its speed is the latest engine's. An earlier engine's quota or
        # dilation (a second engine in a notebook or a test's process) would otherwise stay in force.
        if _speed_owner is not None and _speed_owner.emulator is not None:
            _speed_owner.emulator.close()
            _speed_owner.emulator = None
        self.emulator = start_emulation(emulation, rank)
        _speed_owner = self
        # Joined as the engine started; joined here when the engine's start hook did not run.
        self.memory_cgroup = start_memory_limit(emulation, rank) if self.capacity_bytes else None
        self.speed_check = None  # SpeedCheck: what the quotas achieved at start-up (None: not measured)

    @property
    def mode(self):
        return self.emulator.mode if self.emulator is not None else "none"

    def check_speeds(self, gather, workload=workload_seconds):
        """Measure, on every rank at once, whether the CPU quotas deliver the asked speeds, and under
        ``emulation.mode: auto`` move the quota ranks to dilation where they do not (``SpeedCheck``).

        ``gather(entry, what)`` returns every process's entry (``Agreement.gather_from_every_rank``):
        a collective, run by every process alike. The first gather tells whether any rank holds a
        quota (else nothing more runs); the workload then runs on every rank at once, as training
        does, and its times are gathered. Every rank decides from the same gathered times."""
        if self.emulation is None or not (self.emulation.speeds or self.emulation.speed_schedule):
            return None
        speed = self.emulator.speed if self.emulator is not None else 1.0
        modes = gather((self.rank, speed, self.mode), "the emulation modes of the ranks")
        if not any(mode == "cgroup" for _, _, mode in modes):
            self.speed_check = SpeedCheck(cluster_mode(modes), None, None, False)
            return self.speed_check
        seconds = gather((self.rank, workload()), "the emulation's speed check")
        ranks = sorted({rank for rank, _, _ in modes})
        speeds, times = by_replica((r, s) for r, s, _ in modes), by_replica(seconds)
        asked = [max(speeds[rank]) for rank in ranks]
        # A replica's members (model parallelism) share an emulated rank: the slowest sets its pace.
        took = [max(times[rank]) for rank in ranks]
        achieved = achieved_speeds(asked, took)
        holds = speeds_hold(asked, achieved)
        fell_back = not holds and self.emulation.mode == "auto"
        if fell_back and self.emulator is not None:
            self.emulator.use_dilation()
        mode = "dilation" if fell_back else cluster_mode(modes)
        self.speed_check = SpeedCheck(mode, asked, achieved, fell_back)
        return self.speed_check

    @property
    def memory_mode(self):
        """'cgroup' (a physical limit and the accounting check), 'accounting' or 'none'."""
        if self.memory_cgroup is not None:
            return "cgroup"
        return "accounting" if self.capacity_bytes is not None else "none"

    @property
    def dilates_time(self):
        """Dilation sleeps in proportion to each micro-step's compute, so it must be timed."""
        return self.emulator is not None and self.emulator.mode == "dilation"

    def begin_compute(self):
        if self.emulator is not None:
            self.emulator.begin_compute()

    def after_compute(self, seconds):
        if self.emulator is not None:
            self.emulator.after_compute(seconds)

    def apply_speed_schedule(self, step):
        """Set the speed scheduled for ``step`` (1-based) when it changes."""
        if self.emulator is None:
            return
        speed = scheduled_speed(self.emulation, self.rank, step)
        if speed is not None and speed != self.emulator.speed:
            self.emulator.set_speed(speed)
            logger.info(f"deepspeed-hetero emulation: rank {self.rank} runs at speed {speed} from step {step} "
                        f"({self.emulator.mode})")

    def check_memory(self, micro_batch_size, state_bytes, activation_bytes):
        """Raise EmulatedOutOfMemoryError when model state + activations exceed the emulated capacity."""
        if self.capacity_bytes is None:
            return
        needed = state_bytes + activation_bytes
        if needed > self.capacity_bytes:
            gib = 2.0**30
            raise EmulatedOutOfMemoryError(
                f"deepspeed-hetero emulation: data-parallel rank {self.rank} is out of memory: micro-batch "
                f"{micro_batch_size} needs {needed / gib:.4g} GiB (model state {state_bytes / gib:.4g} GiB + "
                f"activations {activation_bytes / gib:.4g} GiB), its emulated capacity is "
                f"{self.capacity_bytes / gib:.4g} GiB (heterogeneous_config.emulation.memory_gb)")

    def close(self):
        if self.emulator is not None:
            self.emulator.close()
        if self.memory_cgroup is not None:
            self.memory_cgroup.close()
            self.memory_cgroup = None


class SpeedCheck:
    """What the start-up speed check found: the mode slowing the ranks ('cgroup', 'dilation' or
    'none'), the asked and achieved speeds per emulated rank (None: not measured, no quota in
    use), and whether the quota ranks fell back to dilation."""

    def __init__(self, mode, asked, achieved, fell_back):
        self.mode, self.asked, self.achieved, self.fell_back = mode, asked, achieved, fell_back

    @property
    def holds(self):
        return self.achieved is None or speeds_hold(self.asked, self.achieved)


def cluster_mode(modes):
    """The means that slows the ranks, from every rank's ``(rank, speed, mode)``."""
    found = {mode for _, _, mode in modes}
    return "cgroup" if "cgroup" in found else "dilation" if "dilation" in found else "none"


def _speeds(values):
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def emulation_note(emulation, mode, memory_mode="none", check=None):
    """The start-up plan's emulation line: which mode slows the ranks, at what speeds asked and, for
    CPU quotas, measured at start-up (``check``: a ``SpeedCheck``), what emulates their memory;
    where the quotas missed, what was done instead or, with ``mode: cgroup`` set by hand, a warning.
    None without emulation. ``mode``: this rank's emulator's mode, used when nothing was checked."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule or emulation.memory_gb):
        return None
    if check is not None and check.mode != "none":
        mode = check.mode
    elif mode in (None, "none"):  # this rank runs at full speed: the configured mode acts on the others
        mode = emulation.mode
    how = {"cgroup": "CPU-quota cgroups", "dilation": "time dilation",
           "auto": "CPU-quota cgroups where the machine allows them, else time dilation"}.get(mode, mode)
    parts = []
    warning = None
    if emulation.speeds or emulation.speed_schedule:
        speeds = list(emulation.speeds) if emulation.speeds else "1.0 each"
        measured = check is not None and check.achieved is not None
        if measured and check.fell_back:
            source = (f"emulation.mode {emulation.mode}: CPU quotas ran the ranks at {_speeds(check.achieved)} at "
                      f"start-up, beyond {SPEED_TOLERANCE:.0%} of the asked speeds, as when other processes hold "
                      "the cores")
        elif measured:
            source = f"emulation.mode {emulation.mode}; measured at start-up {_speeds(check.achieved)}"
            if not check.holds:
                warning = (f"warning: the CPU quotas do not deliver the asked speeds (beyond {SPEED_TOLERANCE:.0%}), "
                           "as when other processes hold the cores; set heterogeneous_config.emulation.mode to "
                           "\"auto\" or \"dilation\" to emulate slower devices on a busy machine")
        else:
            source = f"emulation.mode {emulation.mode}"
        parts.append(f"speeds {speeds} by {how} ({source})")
        if emulation.speed_schedule:
            parts.append("then " + ", ".join(f"{list(c.speeds)} from step {c.step}" for c in emulation.speed_schedule))
    if emulation.memory_gb:
        parts.append(f"memory_gb {list(emulation.memory_gb)} by {memory_mode}")
    line = "emulated: " + "; ".join(parts)
    return line + ("\n  " + warning if warning else "")


def profiled_speeds_note(emulation, seconds_per_sample, step):
    """What the profiling steps measured of the emulated speeds, where it misses the asked ones by
    more than ``SPEED_TOLERANCE`` (None otherwise, or without emulated speeds). A CPU quota is
    checked before training; time dilation, and a quota whose machine got busier, are measured
    here, by the workload itself: ``seconds_per_sample`` per data-parallel rank
    (``profiling.measured_rates``); ``step``: the last profiling step (a speed schedule's speeds in
    force then). With lists per global rank (pipeline or model parallelism) nothing is compared."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule):
        return None
    world = len(seconds_per_sample)
    if (emulation.speeds and len(emulation.speeds) != world) or any(
            len(change.speeds) != world for change in emulation.speed_schedule or []):
        return None
    asked = []
    for rank in range(world):
        speed = scheduled_speed(emulation, rank, step)
        asked.append(speed if speed is not None else emulation.speeds[rank] if emulation.speeds else 1.0)
    if not all(seconds > 0 for seconds in seconds_per_sample):
        return None  # nothing to compare (a note must never stop training)
    achieved = achieved_speeds(asked, seconds_per_sample)
    if speeds_hold(asked, achieved):
        return None
    return (f"the profiling steps measured the emulated ranks at {_speeds(achieved)} where {_speeds(asked)} was "
            f"asked (beyond {SPEED_TOLERANCE:.0%}: the machine's other work slows the ranks unevenly, or a step's "
            "fixed costs do not scale with the emulated speed); the plan follows what was measured")
