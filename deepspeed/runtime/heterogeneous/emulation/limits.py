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

from .emulator import scheduled_speed, start_emulation, start_memory_limit


class EmulatedOutOfMemoryError(RuntimeError):
    """A rank of an emulated cluster needed more than its emulated memory (``emulation.memory_gb``)."""


class EmulatedLimits:
    """The emulated speed and memory of data-parallel rank ``rank``.

    Args:
        emulation: ``heterogeneous_config.emulation`` (None: no emulation, every method is a no-op).
        rank: this process's data-parallel rank.
        capacity_bytes: this rank's emulated memory capacity, or None when not enforced.
    """

    def __init__(self, emulation, rank, capacity_bytes=None):
        self.emulation = emulation
        self.rank = rank
        self.capacity_bytes = capacity_bytes if emulation is not None and emulation.memory_gb else None
        self.emulator = start_emulation(emulation, rank)
        # Joined as the engine started; joined here when the engine's start hook did not run.
        self.memory_cgroup = start_memory_limit(emulation, rank) if self.capacity_bytes else None

    @property
    def mode(self):
        return self.emulator.mode if self.emulator is not None else "none"

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


BUSY_LOAD_PER_CORE = 0.75
"""A 1-minute load average per core above which the host counts as busy at start-up."""


def emulation_note(emulation, mode, memory_mode="none", load=None, cores=None):
    """The start-up plan's emulation line: which mode slows the ranks and at what speeds, what
    emulates their memory, and a warning where a CPU quota cannot bind (the host's cores already
    busy at start: a quota only caps a rank, it cannot slow one that the load already slows more);
    None without emulation. ``load``/``cores``: the host's 1-minute load average and core count."""
    if emulation is None or not (emulation.speeds or emulation.speed_schedule or emulation.memory_gb):
        return None
    if mode in (None, "none"):  # this rank runs at full speed: the configured mode acts on the others
        mode = emulation.mode
    how = {"cgroup": "CPU-quota cgroups", "dilation": "time dilation",
           "auto": "CPU-quota cgroups where the machine allows them, else time dilation"}.get(mode, mode)
    parts = []
    if emulation.speeds or emulation.speed_schedule:
        speeds = list(emulation.speeds) if emulation.speeds else "1.0 each"
        parts.append(f"speeds {speeds} by {how} (emulation.mode {emulation.mode})")
        if emulation.speed_schedule:
            parts.append("then " + ", ".join(f"{list(c.speeds)} from step {c.step}" for c in emulation.speed_schedule))
    if emulation.memory_gb:
        parts.append(f"memory_gb {list(emulation.memory_gb)} by {memory_mode}")
    line = "emulated: " + "; ".join(parts)
    if mode == "cgroup" and load is not None and cores and load > BUSY_LOAD_PER_CORE * cores:
        line += (f"\n  warning: this host is busy (load average {load:.1f} on {cores} cores): a CPU quota cannot slow "
                 f"a rank that other processes already slow, so the emulated speeds may not hold; set "
                 f"heterogeneous_config.emulation.mode to \"dilation\" to emulate slower devices on a busy machine")
    return line
