# SPDX-License-Identifier: Apache-2.0
"""Wall time this process spends inside collectives, waiting for peers included.

A rank's measured forward+backward contains the time it waits for slower peers at every
collective inside it (ZeRO-2/3 reduce and gather during backward and forward); that is the
slow rank's time leaking into the fast rank's measurement. The planner needs each rank's own
compute, so the engine subtracts what this clock accumulated over the micro-step. Every
deepspeed.comm collective reports here (comm.timed_op) once the fork is on in this process
(``enable()``, called when a heterogeneous config is built); an asynchronous one is timed when its
handle is waited on. Nested calls count once. With the fork off, timed_op pays one branch on a
module attribute: no timing and no wrapper around async handles.

The same call site serves ``collective_log``: a listener set with ``set_listener`` sees every
collective (the undecorated function and its arguments) before it runs, so that tests can compare
the ranks' sequences without a second hook in deepspeed.comm. A listener alone does not start
the timing.
"""

import threading
import time

import torch


class _Clock(threading.local):

    def __init__(self):
        self.total = 0.0
        self.depth = 0
        self.entered = 0.0


_clock = _Clock()

enabled = False
"""Read by deepspeed.comm.timed_op on every collective: True once a heterogeneous config was built
(the clock runs) or while a listener is set."""

_timing = False  # the clock runs: a heterogeneous config was built in this process
listener = None  # called as listener(func, args, kwargs) before each collective; None: none


def enable():
    global _timing, enabled
    _timing = True
    enabled = True


def set_listener(callback):
    """Have ``callback(func, args, kwargs)`` see every deepspeed.comm collective; None removes it."""
    global listener, enabled
    listener = callback
    enabled = _timing or callback is not None


def enter():
    if _clock.depth == 0:
        _clock.entered = time.perf_counter()
    _clock.depth += 1


def leave():
    _clock.depth -= 1
    if _clock.depth == 0:
        _clock.total += time.perf_counter() - _clock.entered


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
            return self._work.wait(*args, **kwargs)
        finally:
            leave()

    def __getattr__(self, name):
        return getattr(self._work, name)


def timed_call(func, *args, **kwargs):
    """Run a collective inside the clock; a returned work handle (async_op=True) is wrapped so that
    its ``wait()`` counts too. Tensors and None pass through."""
    if listener is not None:
        listener(func, args, kwargs)
        if not _timing:
            return func(*args, **kwargs)
    enter()
    try:
        result = func(*args, **kwargs)
    finally:
        leave()
    if result is None or isinstance(result, torch.Tensor) or not hasattr(result, "wait"):
        return result
    return TimedWork(result)
