# SPDX-License-Identifier: Apache-2.0
"""Wall time this process spends inside collectives, waiting for peers included.

A rank's measured forward+backward contains the time it waits for slower peers at every
collective inside it (ZeRO-2/3 reduce and gather during backward and forward); that is the
slow rank's time leaking into the fast rank's measurement. The planner needs each rank's own
compute, so the engine subtracts what this clock accumulated over the micro-step. Every
deepspeed.comm collective reports here (comm.timed_op) while the runtime controller has the clock
on (``set_timing``: profiling, verifying, monitoring, recording, time dilation); an asynchronous
one is timed when its handle is waited on. Nested calls count once. With the fork off, timed_op pays one branch on a
module attribute: no timing and no wrapper around async handles.

The same call site serves ``collective_log``: a listener set with ``set_listener`` sees every
collective (the undecorated function and its arguments) before it runs, so that tests can compare
the ranks' sequences without a second hook in deepspeed.comm. A listener alone does not start
the timing.

Asynchronous devices (CUDA and NCCL) return from a collective once it is enqueued: host time
stamps around it then see neither the compute still running before it nor the wait for a slower
peer, which lands in whatever synchronises next, the rank's "compute". While the runtime times
each micro-step (profiling and recording steps, time dilation), ``synchronize_collectives(True)``
makes every collective synchronise the device before it starts (the compute before it is done and
counted as compute) and after it ends (its wait and transfer counted here). Synchronous devices
(the CPU accelerator, gloo) need nothing and get nothing; other steps are not synchronised.
"""

import os
import threading
import time

import torch


class _Clock(threading.local):

    def __init__(self):
        self.total = 0.0
        self.run_queue_total = 0.0  # seconds waiting for a core inside collectives (track_run_queue)
        self.depth = 0
        self.entered = 0.0
        self.run_queue_entered = 0.0
        self.background = False  # a worker thread's collectives: no dilation, no device synchronisation


_clock = _Clock()

GROUP_THREADS_ENV = "DEEPSPEED_HETERO_CHECK_GROUP_THREADS"
"""Set to 1 (the test harness does, for every process it starts): ``timed_call`` checks that no two
threads are inside a collective on the same process group at once (``check_group_threads``)."""
_check_groups = os.environ.get(GROUP_THREADS_ENV) == "1"

enabled = _check_groups
"""Read by deepspeed.comm.timed_op on every collective: True while the clock runs, a listener is
set or the group check is on."""

_timing = False  # the clock runs (set_timing)
listener = None  # called as listener(func, args, kwargs) before each collective; None: none
before_collective = None
"""Called with no arguments before each outermost collective starts, outside the clock (its time
counts as the rank's own): time dilation stretches the compute that preceded the collective
there (``emulation.Emulator``), so that a peer waits at the collective as it would for a slower
device."""
_synchronize = None  # the device's synchronize() while collectives are timed on an async device
seconds_dilated = 0.0
"""Seconds time dilation slept before collectives in this process (``before_collective``): the
emulated slower compute, which a span that contains a collective leaves out of its own time."""


def synchronize_collectives(on, accelerator=None):
    """Synchronise the device around every collective (``on``) or not; only where the accelerator
    is asynchronous (``is_synchronized_device()`` False). Returns whether it now does."""
    global _synchronize
    if on:
        if accelerator is None:
            from deepspeed.accelerator import get_accelerator
            accelerator = get_accelerator()
        _synchronize = None if accelerator.is_synchronized_device() else accelerator.synchronize
    else:
        _synchronize = None
    return _synchronize is not None


def set_timing(on):
    """Run the clock (``on``) or not: the runtime controller runs it only while something reads it."""
    global _timing, enabled
    _timing = bool(on)
    enabled = _timing or listener is not None or _check_groups


def enable():
    set_timing(True)


def set_listener(callback):
    """Have ``callback(func, args, kwargs)`` see every deepspeed.comm collective; None removes it."""
    global listener, enabled
    listener = callback
    enabled = _timing or callback is not None or _check_groups


def enter():
    if _clock.depth == 0:
        _clock.entered = time.perf_counter()
        if _track_run_queue:
            _clock.run_queue_entered = run_queue_seconds() or 0.0
    _clock.depth += 1


def leave():
    _clock.depth -= 1
    if _clock.depth == 0:
        _clock.total += time.perf_counter() - _clock.entered
        if _track_run_queue:
            _clock.run_queue_total += (run_queue_seconds() or 0.0) - _clock.run_queue_entered


_track_run_queue = False


def track_run_queue(on):
    """Count each thread's waits for a core inside collectives too (``run_queue_in_collectives``):
    for time dilation's ``own`` clock, which reads a rank's waits outside them."""
    global _track_run_queue
    _track_run_queue = bool(on)


def run_queue_seconds():
    """The calling thread's time runnable but waiting for a core, in seconds (Linux
    ``/proc/thread-self/schedstat``); None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def run_queue_in_collectives():
    """Running total of this thread's waits for a core inside collectives (``track_run_queue``)."""
    return _clock.run_queue_total


def mark_background_thread():
    """Mark the calling thread as a background worker (``comm/overlap.py``): its collectives overlap
    the main thread's compute, so they neither run time dilation (``before_collective`` stretches
    the main thread's compute) nor synchronise the device, and their time is not the rank's
    (this thread's total, which nothing reads). The collective log keeps them apart."""
    _clock.background = True


def in_background_thread():
    return _clock.background


def seconds_in_collectives():
    """Running total for this thread; differences between two readings give the time in between."""
    return _clock.total


class TimedWork:
    """An async collective's handle whose ``wait()`` counts as time in collectives."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        enter()
        try:
            result = self._work.wait(*args, **kwargs)
            if _synchronize is not None and _clock.depth == 1:
                _synchronize()  # the transfer itself, not only its enqueueing
            return result
        finally:
            leave()

    def __getattr__(self, name):
        return getattr(self._work, name)


class GroupSharedError(RuntimeError):
    """Two threads of one process inside collectives on the same process group at once: their calls
    could pair with the peers' in another order on each rank (a hang or a wrong result)."""


_groups_lock = threading.Lock()
_groups_in_use = {}  # id(group), or "default" -> (thread, collective)


def check_group_threads(on):
    """Check (``on``) that each process group is used by one thread at a time, as the overlap worker
    (``comm/overlap.py``) and the main thread must: a collective that finds another thread inside one
    on its group raises ``GroupSharedError`` naming both. Off by default (``GROUP_THREADS_ENV``)."""
    global _check_groups, enabled
    _check_groups = bool(on)
    enabled = _timing or listener is not None or _check_groups


def _group_of(args, kwargs):
    import torch.distributed as dist
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return "default" if group is None else id(group)


def _claim(func, args, kwargs):
    """Mark this thread inside a collective on its group; returns the key to release, or None for a
    collective nested in one of this thread's on the same group."""
    key = _group_of(args, kwargs)
    thread = threading.current_thread()
    name = getattr(func, "__name__", str(func))
    with _groups_lock:
        holder = _groups_in_use.get(key)
        if holder is not None and holder[0] is thread:
            return None
        if holder is not None:
            raise GroupSharedError(
                f"deepspeed-hetero: {name} on thread {thread.name!r} started on a process group (id {key}) that "
                f"thread {holder[0].name!r} is inside {holder[1]} on: one group, one thread at a time")
        _groups_in_use[key] = (thread, name)
    return key


def timed_call(func, *args, **kwargs):
    """``_timed_call``, with the group check (``check_group_threads``) around it when it is on."""
    if not _check_groups:
        return _timed_call(func, *args, **kwargs)
    key = _claim(func, args, kwargs)
    try:
        return _timed_call(func, *args, **kwargs)
    finally:
        if key is not None:
            with _groups_lock:
                del _groups_in_use[key]


def _timed_call(func, *args, **kwargs):
    """Run a collective inside the clock; a returned work handle (async_op=True) is wrapped so that
    its ``wait()`` counts too. Tensors and None pass through."""
    hear = listener  # read once: a recording may end on another thread meanwhile (comm/overlap.py's worker)
    if hear is not None:
        hear(func, args, kwargs)
        if not _timing:
            return func(*args, **kwargs)
    if before_collective is not None and _clock.depth == 0 and not _clock.background:
        before_collective()
    sync = _synchronize if _clock.depth == 0 and not _clock.background else None
    if sync is not None:
        sync()  # the compute queued before the collective is the rank's own, not collective time
    enter()
    try:
        result = func(*args, **kwargs)
        if sync is not None and (result is None or isinstance(result, torch.Tensor) or not hasattr(result, "wait")):
            sync()  # a blocking collective is done when the device says so
    finally:
        leave()
    if result is None or isinstance(result, torch.Tensor) or not hasattr(result, "wait"):
        return result
    return TimedWork(result)
