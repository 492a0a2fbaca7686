# SPDX-License-Identifier: Apache-2.0
"""Emulation a user can see and trust: the start-up plan's line on how the ranks are emulated and
at what speeds they were measured, and the start-up speed check's decision (a CPU quota that does
not deliver its speed, as beside busy processes, gives way to dilation under ``mode: auto``)."""

import pytest

from deepspeed.runtime.heterogeneous.config.blocks import EmulationConfig
from deepspeed.runtime.heterogeneous.emulation.emulator import achieved_speeds, speeds_hold
from deepspeed.runtime.heterogeneous.emulation.limits import (EmulatedLimits, SpeedCheck, emulation_note,
                                                              profiled_speeds_note)


def test_the_start_up_plan_says_how_ranks_are_emulated():
    emulation = EmulationConfig(speeds=[1.0, 0.5], memory_gb=[8, 4],
                                speed_schedule=[{"step": 10, "speeds": [0.5, 1.0]}])
    line = emulation_note(emulation, "cgroup", "cgroup", SpeedCheck("cgroup", [1.0, 0.5], [1.0, 0.52], False))
    assert line == ("emulated: speeds [1.0, 0.5] by CPU-quota cgroups (emulation.mode auto; measured at start-up "
                    "[1.00, 0.52]); then [0.5, 1.0] from step 10; memory_gb [8.0, 4.0] by cgroup"), line
    # Auto fell back: the line names the mode in force and what the quotas achieved.
    fell_back = emulation_note(emulation, "dilation", "cgroup", SpeedCheck("dilation", [1.0, 0.5], [1.0, 0.86], True))
    assert fell_back.startswith("emulated: speeds [1.0, 0.5] by time dilation (emulation.mode auto: CPU quotas ran "
                                "the ranks at [1.00, 0.86] at start-up, beyond 15% of the asked speeds"), fell_back
    assert "warning" not in fell_back
    # mode "cgroup" set by hand is kept, with a warning that says what to do.
    by_hand = EmulationConfig(speeds=[1.0, 0.5], mode="cgroup")
    missed = emulation_note(by_hand, "cgroup", "none", SpeedCheck("cgroup", [1.0, 0.5], [1.0, 0.86], False))
    assert "measured at start-up [1.00, 0.86]" in missed and "warning: the CPU quotas do not deliver" in missed
    assert '"dilation"' in missed, missed
    assert emulation_note(None, "none") is None
    # Rank 0 at full speed has no emulator of its own: the configured mode is what acts on the others.
    assert "by time dilation (emulation.mode dilation)" in emulation_note(
        EmulationConfig(speeds=[1.0, 0.25], mode="dilation"), "none")
    # Rank 0's own mode is "none"; the check says what acts on the others.
    assert "by CPU-quota cgroups" in emulation_note(emulation, "none", "none",
                                                    SpeedCheck("cgroup", [1.0, 0.5], [1.0, 0.5], False))


def test_achieved_speeds_are_relative_to_the_unthrottled_ranks():
    # Rank 1 asked 0.4: 2.5x rank 0's time is 0.4; 1.2x is 0.83 (a quota that did not bind).
    assert achieved_speeds([1.0, 0.4], [0.10, 0.25]) == [1.0, 0.4]
    assert achieved_speeds([1.0, 0.4], [0.10, 0.12]) == [1.0, 0.833]
    # No unthrottled rank: the fastest asked rank is taken at its asked speed.
    assert achieved_speeds([0.5, 0.25], [0.2, 0.4]) == [0.5, 0.25]
    assert speeds_hold([1.0, 0.4], [1.0, 0.45]) and not speeds_hold([1.0, 0.4], [1.0, 0.47])
    assert speeds_hold([1.0, 0.4], [1.0, 0.35]) and not speeds_hold([1.0, 0.4], [1.0, 0.33])


class _Ranks:
    """Two ranks' gathers played in order: this rank's entry and the peer's, as
    ``Agreement.gather_from_every_rank`` returns them (global rank order)."""

    def __init__(self, peer_entries):
        self.peer_entries = list(peer_entries)
        self.whats = []

    def __call__(self, entry, what):
        self.whats.append(what)
        return [self.peer_entries.pop(0), entry]


@pytest.fixture
def cpu_quotas():
    from harness import require_cpu_quotas
    require_cpu_quotas()


def test_a_quota_that_misses_its_speed_falls_back_to_dilation_under_auto(cpu_quotas):
    # Rank 1 of [1.0, 0.4] in a real quota cgroup; the gathered times are given: the peer took
    # 0.10 s for the workload, this rank 0.12 s, 0.83 of the peer's speed instead of 0.4.
    limits = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4]), rank=1)
    try:
        assert limits.mode == "cgroup"
        quota = limits.emulator._cgroup.path
        gather = _Ranks([(0, 1.0, "none"), (0, 0.10)])
        check = limits.check_speeds(gather, workload=lambda: 0.12)
        assert gather.whats == ["the emulation modes of the ranks", "the emulation's speed check"]
        assert check.fell_back and check.achieved == [1.0, 0.833] and limits.mode == "dilation"
        assert limits.emulator._cgroup is None and not quota.exists()  # the process left its quota
        limits.emulator.set_speed(0.5)  # later speed changes stay with dilation
        assert limits.mode == "dilation" and limits.emulator._cgroup is None
    finally:
        limits.close()
    # Delivered: the quota stays.
    kept = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4]), rank=1)
    try:
        check = kept.check_speeds(_Ranks([(0, 1.0, "none"), (0, 0.10)]), workload=lambda: 0.26)
        assert not check.fell_back and check.holds and kept.mode == "cgroup" and kept.emulator._cgroup is not None
    finally:
        kept.close()
    # Set by hand: kept, and the check says it missed.
    by_hand = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4], mode="cgroup"), rank=1)
    try:
        check = by_hand.check_speeds(_Ranks([(0, 1.0, "none"), (0, 0.10)]), workload=lambda: 0.12)
        assert not check.fell_back and not check.holds and by_hand.mode == "cgroup"
    finally:
        by_hand.close()


def test_no_quota_no_workload():
    limits = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4], mode="dilation"), rank=1)
    gather = _Ranks([(0, 1.0, "none")])
    check = limits.check_speeds(gather, workload=lambda: 1 / 0)
    assert gather.whats == ["the emulation modes of the ranks"] and check.mode == "dilation" and check.achieved is None
    assert EmulatedLimits(None, rank=0).check_speeds(gather) is None


def test_a_second_engine_in_the_process_replaces_the_first_ones_speed(cpu_quotas):
    """A process is one rank: an earlier engine's quota must not stay in force under a new one
    (measured before: a second engine at dilation 0.4 ran 3.8-13x slower, under both)."""
    first = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4]), rank=1)
    quota = first.emulator._cgroup.path
    second = EmulatedLimits(EmulationConfig(speeds=[1.0, 0.4], mode="dilation"), rank=1)
    try:
        assert first.emulator is None and first.mode == "none" and not quota.exists()
        assert second.mode == "dilation"
    finally:
        first.close()
        second.close()


def test_the_profiled_speeds_are_compared_with_the_asked_ones():
    """Dilation (and a quota on a machine that got busier) is measured by the profiling steps
    themselves: rank 1 asked 0.4, measured at 4.0x rank 0's seconds per sample (0.25), is said;
    at 2.6x (0.385) it is within 15% and nothing is said."""
    emulation = EmulationConfig(speeds=[1.0, 0.4], mode="dilation")
    line = profiled_speeds_note(emulation, [0.010, 0.040], step=5)
    assert line.startswith("the profiling steps measured the emulated ranks at [1.00, 0.25] where [1.00, 0.40] "
                           "was asked (beyond 15%"), line
    assert profiled_speeds_note(emulation, [0.010, 0.026], step=5) is None
    # The speeds in force at the last profiling step; lists per global rank are not compared.
    scheduled = EmulationConfig(speeds=[1.0, 1.0], speed_schedule=[{"step": 2, "speeds": [1.0, 0.5]}])
    assert profiled_speeds_note(scheduled, [0.010, 0.020], step=5) is None
    assert "where [1.00, 1.00] was asked" in profiled_speeds_note(scheduled, [0.010, 0.020], step=1)
    assert profiled_speeds_note(EmulationConfig(speeds=[1.0, 0.5, 1.0, 0.5]), [0.01, 0.04], step=5) is None
    assert profiled_speeds_note(None, [0.01, 0.04], step=5) is None
