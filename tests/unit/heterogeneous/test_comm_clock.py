# SPDX-License-Identifier: Apache-2.0
"""The collective clock costs nothing with the fork off and counts every collective while the fork's
runtime controller is in a phase that reads it (profiling here)."""

import pytest
import torch

from harness import run_ranks


def _clock_off_then_on(rank, world_size):
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    def build(heterogeneous):
        model = torch.nn.Linear(4, 4)
        config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        if heterogeneous:
            config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "compute_aware"}
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        if heterogeneous:
            engine._heterogeneous_runtime()  # the controller starts (at the first hook): profiling reads the clock
        return engine

    def async_all_reduce():
        before = comm_clock.seconds_in_collectives()
        handle = dist.all_reduce(torch.ones(1024), async_op=True)
        wrapped = isinstance(handle, comm_clock.TimedWork)
        handle.wait()
        return wrapped, comm_clock.seconds_in_collectives() - before

    build(heterogeneous=False)
    off = (comm_clock.enabled, *async_all_reduce())
    build(heterogeneous=True)
    on = (comm_clock.enabled, *async_all_reduce())
    return {"off": off, "on": on}


@pytest.mark.multiprocess
def test_clock_is_inert_with_the_fork_off_and_counts_with_it_on():
    # Without the test harness's group check, which turns the clock's call site on in every process.
    for result in run_ranks(_clock_off_then_on, world_size=2, timeout=180,
                            env={"DEEPSPEED_HETERO_CHECK_GROUP_THREADS": None}):
        assert result["off"] == (False, False, 0.0)  # no wrapper, no time counted
        enabled, wrapped, seconds = result["on"]
        assert enabled and wrapped and seconds > 0.0


class _Device:
    """An accelerator's two answers the clock asks for: whether it runs behind the host, and a
    synchronize() whose calls are recorded with what the clock had counted at that moment."""

    def __init__(self, synchronized):
        self.synchronized, self.calls = synchronized, []

    def is_synchronized_device(self):
        return self.synchronized

    def synchronize(self):
        from deepspeed.runtime.heterogeneous.measure import comm_clock
        self.calls.append(comm_clock._clock.depth)


def test_an_asynchronous_device_is_synchronised_around_collectives_only_while_micro_steps_are_timed():
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    class Handle:
        def wait(self):
            return None

    device = _Device(synchronized=False)
    try:
        assert comm_clock.synchronize_collectives(True, device)
        comm_clock.timed_call(lambda: None)  # blocking: before (outside the clock) and after (inside)
        assert device.calls == [0, 1]
        handle = comm_clock.timed_call(lambda: Handle())  # async: before issuing, then at wait()
        assert device.calls == [0, 1, 0]
        handle.wait()
        assert device.calls == [0, 1, 0, 1]
        comm_clock.timed_call(lambda: comm_clock.timed_call(lambda: None))  # nested: counted once
        assert device.calls == [0, 1, 0, 1, 0, 1]
        assert not comm_clock.synchronize_collectives(False, device)
        comm_clock.timed_call(lambda: None)
        assert len(device.calls) == 6  # steps that are not timed per micro-step pay nothing
        # The CPU accelerator (synchronous) is never synchronised.
        cpu = _Device(synchronized=True)
        assert not comm_clock.synchronize_collectives(True, cpu)
        comm_clock.timed_call(lambda: None)
        assert cpu.calls == []
    finally:
        comm_clock.synchronize_collectives(False)


def _dilated_rank_before_a_collective(rank, world_size):
    """Rank 1 at speed 0.25 by time dilation: 40 ms of compute, an all-reduce, 20 ms more. Returns
    the time each rank spent inside the all-reduce and in rank 1's closing sleep."""
    import time

    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    from deepspeed.runtime.heterogeneous.emulation.emulator import Emulator

    comm_clock.enable()
    emulator = Emulator(1.0 if rank == 0 else 0.25, mode="dilation")
    dist.barrier()
    emulator.begin_compute()
    time.sleep(0.04)  # the micro-step's compute up to its first collective
    before = comm_clock.seconds_in_collectives()
    dist.all_reduce(torch.ones(8))
    waited = comm_clock.seconds_in_collectives() - before
    time.sleep(0.02)
    closing = time.perf_counter()
    emulator.after_compute()
    closing = time.perf_counter() - closing
    emulator.close()
    return emulator.mode, waited, closing, comm_clock.before_collective is None


@pytest.mark.multiprocess
def test_time_dilation_stretches_the_compute_before_each_collective():
    """A slow device reaches a collective late by its own slowness: the fast rank must wait there
    (3 x 40 ms = 120 ms), not after the micro-step; the closing sleep stretches only the 20 ms after
    the collective (60 ms, not 180)."""
    (mode0, waited0, _, cleared0), (mode1, _, closing1, cleared1) = run_ranks(_dilated_rank_before_a_collective,
                                                                               world_size=2, timeout=120)
    assert mode0 == "none" and mode1 == "dilation"
    assert waited0 >= 0.1, f"the fast rank waited {waited0:.3f} s at the collective, expected about 0.12"
    # At least the 60 ms the stretch adds (a sleep never ends early); an upper bound would measure
    # the machine's load, not the dilation (180 ms would mean the compute before the collective was
    # stretched again: tests/unit/heterogeneous/test_emulation_note.py's pure checks cover the rule).
    assert closing1 >= 0.055, f"the closing sleep was {closing1:.3f} s, expected about 0.06"
    assert cleared0 and cleared1, "the dilation hook must not outlive the micro-step"


def _dilated_wait_for_the_worker(rank, world_size):
    """Speed 0.25 by time dilation: 40 ms of compute, then a wait for an overlap worker's job that
    finishes 50 ms later. Returns the seconds dilation slept at the wait."""
    import threading
    import time

    from deepspeed.runtime.heterogeneous.comm.overlap import _Job, wait_for_job
    from deepspeed.runtime.heterogeneous.emulation.emulator import Emulator
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    comm_clock.enable()
    emulator = Emulator(0.25, mode="dilation")
    job = _Job(None, None)
    emulator.begin_compute()
    slept = comm_clock.seconds_dilated
    time.sleep(0.04)  # the forward's compute up to a module that waits for its parameters
    threading.Thread(target=lambda: (time.sleep(0.05), job.done.set())).start()
    wait_for_job(job, "test job")
    slept = comm_clock.seconds_dilated - slept
    emulator.after_compute()
    emulator.close()
    return slept


def test_time_dilation_stretches_the_compute_before_a_wait_for_the_overlap_worker():
    """A slower device reaches a wait for the worker (the forward's wait for its parameters) later by
    its own slowness, as it reaches a collective: the 40 ms before it are stretched there (120 ms more),
    so the worker's job runs beside the stretched compute, as beside a slower device's."""
    (slept, ) = run_ranks(_dilated_wait_for_the_worker, world_size=1, timeout=120)
    assert slept >= 0.11, f"dilation slept {slept:.3f} s before the wait, expected about 0.12"


def test_dilation_sleep_with_and_without_the_waits_for_a_core():
    from deepspeed.runtime.heterogeneous.emulation.emulator import dilation_sleep

    # elapsed (no waiting given): (1/speed - 1) x the compute.
    assert dilation_sleep(0.25, 0.04) == pytest.approx(0.12)
    assert dilation_sleep(0.5, 0.1, waiting=0.0) == pytest.approx(0.1)
    # own: 0.1 s of which 0.04 waited for a core: 0.06 s of the rank's own, 0.12 s at half speed, 0.02 left.
    assert dilation_sleep(0.5, 0.1, waiting=0.04) == pytest.approx(0.02)
    # The wait alone took longer than the slower device would have: no sleep; never below zero.
    assert dilation_sleep(0.5, 0.1, waiting=0.08) == 0.0
    assert dilation_sleep(0.5, 0.1, waiting=0.5) == 0.0 and dilation_sleep(0.5, 0.1, waiting=-1.0) == pytest.approx(0.1)


def _beside_a_busy_neighbour(clock):
    """Speed 0.5 by dilation with ``clock``, 0.1 s of compute three times on one core shared with a
    busy loop; returns the last interval's (run-queue wait, elapsed, slept) in seconds."""
    import os
    import subprocess
    import sys
    import time

    from deepspeed.runtime.heterogeneous.emulation.emulator import Emulator
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    saved = os.sched_getaffinity(0)
    core = min(saved)
    rival = subprocess.Popen([sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{core}}})\n"
                              "end = time.time() + 60\nwhile time.time() < end: pass"])
    emulator = None
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.3)  # the neighbour is running
        emulator = Emulator(0.5, mode="dilation", clock=clock)
        for _ in range(3):
            emulator.begin_compute()
            waited, began, slept = comm_clock.run_queue_seconds(), time.perf_counter(), comm_clock.seconds_dilated
            _compute(0.1)
            waited, elapsed = comm_clock.run_queue_seconds() - waited, time.perf_counter() - began
            emulator.after_compute()
            slept = comm_clock.seconds_dilated - slept
    finally:
        if emulator is not None:
            emulator.close()
        os.sched_setaffinity(0, saved)
        rival.kill()
        rival.wait()
    return waited, elapsed, slept


def test_dilation_clock_own_leaves_out_the_wait_for_a_shared_core():
    """A busy loop on the same core: the kernel counts the rank's wait for the core. At speed 0.5,
    ``elapsed`` sleeps the whole elapsed time again (a rank at full speed waits as much here, so the
    ratio holds); ``own`` stretches only the rank's own 0.1 s, to 0.2 s in all, most of it past."""
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    if comm_clock.run_queue_seconds() is None:
        pytest.skip("the kernel gives no run-queue time (/proc/thread-self/schedstat)")
    waited, elapsed, slept = _beside_a_busy_neighbour("elapsed")
    assert waited > 0.25 * elapsed, f"waited {waited:.3f} s of {elapsed:.3f} s beside a busy loop on one core"
    assert slept >= 0.99 * elapsed, f"elapsed: slept {slept:.3f} s after {elapsed:.3f} s"
    waited, elapsed, slept = _beside_a_busy_neighbour("own")
    assert waited > 0.25 * elapsed, f"waited {waited:.3f} s of {elapsed:.3f} s beside a busy loop on one core"
    assert slept <= max(0.0, 0.2 - elapsed) + 0.02 and slept < 0.5 * elapsed, \
        f"own: slept {slept:.3f} s after {elapsed:.3f} s"
    assert not comm_clock._track_run_queue, "closing the emulator stops counting waits inside collectives"


def test_the_dilation_clock_reaches_the_emulator_and_a_wrong_one_is_refused():
    from deepspeed.runtime.heterogeneous.config.blocks import EmulationConfig
    from deepspeed.runtime.heterogeneous.emulation.emulator import Emulator, start_emulation

    from deepspeed.runtime.heterogeneous.measure import comm_clock

    for clock in ("elapsed", "own"):
        emulator = start_emulation(EmulationConfig(speeds=[0.5], mode="dilation", dilation_clock=clock), 0)
        try:
            # "own" without the kernel's run-queue time stretches the elapsed time, and says so.
            expected = clock if comm_clock.run_queue_seconds() is not None else "elapsed"
            assert emulator.mode == "dilation" and emulator.clock == expected
        finally:
            emulator.close()
    with pytest.raises(ValueError, match="dilation_clock 'wall' is not allowed; use \"elapsed\" or \"own\""):
        Emulator(0.5, mode="dilation", clock="wall")


def _compute(seconds):
    """Busy the calling thread for ``seconds`` of its CPU time."""
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_two_threads_inside_collectives_on_one_group_are_refused():
    """The group check (on in every test process): a second thread entering a collective on a group
    another thread is inside stops with both named; nested calls of one thread and other groups pass."""
    import threading
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    inside, release = threading.Event(), threading.Event()
    group, other = object(), object()

    def worker_collective(group=None):
        inside.set()
        release.wait(30)

    def nested(group=None):
        return comm_clock.timed_call(lambda group=None: "inner", group=group)

    was = comm_clock._check_groups
    comm_clock.check_group_threads(True)
    try:
        worker = threading.Thread(target=comm_clock.timed_call, args=(worker_collective,), kwargs={"group": group},
                                  name="overlap-worker")
        worker.start()
        assert inside.wait(30)
        with pytest.raises(comm_clock.GroupSharedError, match="'overlap-worker' is inside worker_collective"):
            comm_clock.timed_call(lambda group=None: None, group=group)
        assert comm_clock.timed_call(nested, group=other) == "inner"  # another group, nested on one thread
        release.set()
        worker.join(30)
        assert comm_clock.timed_call(lambda group=None: "after", group=group) == "after"  # released
        assert comm_clock._groups_in_use == {}
    finally:
        release.set()
        comm_clock.check_group_threads(was)
