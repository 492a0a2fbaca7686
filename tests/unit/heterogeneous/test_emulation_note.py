# SPDX-License-Identifier: Apache-2.0
"""Emulation a user can see: the start-up plan's line on how the ranks are emulated, and the
warning where a CPU quota cannot bind on a busy host."""


def test_the_start_up_plan_says_how_ranks_are_emulated():
    from deepspeed.runtime.heterogeneous.config.blocks import EmulationConfig
    from deepspeed.runtime.heterogeneous.emulation.limits import emulation_note
    emulation = EmulationConfig(speeds=[1.0, 0.5], memory_gb=[8, 4],
                                speed_schedule=[{"step": 10, "speeds": [0.5, 1.0]}])
    line = emulation_note(emulation, "cgroup", "cgroup", load=0.5, cores=2)
    assert line == ("emulated: speeds [1.0, 0.5] by CPU-quota cgroups (emulation.mode auto); then [0.5, 1.0] from "
                    "step 10; memory_gb [8.0, 4.0] by cgroup"), line
    # Load 4 on 2 cores: a quota cannot slow a rank that the load already slows; dilation can.
    busy = emulation_note(emulation, "cgroup", "cgroup", load=4.0, cores=2)
    assert "warning: this host is busy (load average 4.0 on 2 cores)" in busy and '"dilation"' in busy, busy
    assert "warning" not in emulation_note(emulation, "dilation", "accounting", load=4.0, cores=2)
    assert emulation_note(None, "none") is None
    # Rank 0 at full speed has no emulator of its own: the configured mode is what acts on the others.
    assert "by time dilation (emulation.mode dilation)" in emulation_note(
        EmulationConfig(speeds=[1.0, 0.25], mode="dilation"), "none")
