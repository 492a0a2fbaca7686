# SPDX-License-Identifier: Apache-2.0
"""This rank's own time per micro-step and per optimizer step.

"Own" time is wall time minus the time spent inside collectives (``comm_clock``), where a fast
rank waits for slower peers: what the planner needs is each rank's compute, not its waiting.

Two ways to time, chosen per micro-step by the runtime:

- per micro-step (profiling, the profiler's recording, time dilation): the device is
  synchronised at both ends of every micro-step and once more at the step's end, which gives
  each micro-step's forward+backward apart from the optimizer step;
- per step (dynamic rebalancing's monitoring): no synchronisation inside the step; the host
  marks the first micro-step's start (the device is idle there: the previous step ended with a
  synchronisation) and the step's end synchronises once. A device keeps running behind the host,
  so only the whole step is a true time; each micro-step is given an equal share of it, the
  optimizer step included. That costs one synchronisation per optimizer step instead of 2-3 per
  micro-step, which on a GPU stalls the host's queueing of the next kernels each time.

Both report, per step, the time per micro-step including the step's share of the optimizer
step (``StepTiming.time_per_micro_step``), so drift measured in either way is comparable.
"""

import time
from dataclasses import dataclass, field
from typing import List

from deepspeed.accelerator import get_accelerator

from . import comm_clock


def _mark():
    return time.perf_counter(), comm_clock.seconds_in_collectives()


def _own_since(mark):
    began, in_collectives = mark
    return time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives)


@dataclass
class StepTiming:
    """One optimizer step of this rank."""

    samples: List[tuple]
    """Per micro-step: (micro-batch size, own seconds, activation bytes or None)."""
    step_overhead: float
    """Own seconds from the last backward to the step's end (optimizer step); 0 when per-step timed."""
    wall: float
    """Wall seconds since the previous step's end."""
    in_collectives: float
    """Seconds inside collectives since the previous step's end."""
    split: List[tuple] = field(default_factory=list)
    """Per micro-step (forward, backward) own seconds, when asked for."""

    @property
    def time_per_micro_step(self):
        """Own seconds per micro-step with the step's optimizer share; None without micro-steps."""
        timed = [t for _, t, _ in self.samples if t is not None]
        if not timed:
            return None
        return (sum(timed) + self.step_overhead) / len(timed)

    def record(self, step, micro_batch_size, resplit_input_bytes=0, resplit_output_bytes=0):
        """The heterogeneous profiler's record of this step (plain values): where its time went,
        and the bytes of re-split inputs and returned outputs this rank received during it."""
        activations = [b for _, _, b in self.samples if b is not None]
        return {
            "step": step,
            "micro_batch_size": micro_batch_size,
            "samples": sum(m for m, _, _ in self.samples),
            "compute_s": sum(t for _, t, _ in self.samples),
            "forward_s": sum(f for f, _ in self.split),
            "backward_s": sum(b for _, b in self.split),
            "optimizer_s": self.step_overhead,
            "collective_s": self.in_collectives,
            "wall_s": self.wall,
            "activation_bytes": max(activations) if activations else None,
            "resplit_input_bytes": resplit_input_bytes,
            "resplit_output_bytes": resplit_output_bytes,
        }


class StepTimer:
    """Marks taken by the engine's hooks; ``end_step`` returns the step's ``StepTiming``."""

    def __init__(self):
        self._micro_steps = []  # (size, seconds or None until the step's end, activation bytes)
        self._split = []
        self._began = None  # per-micro-step timing: this micro-step's start
        self._forward_s = None
        self._backward_done = None
        self._step_began = None  # per-step timing: the first micro-step's start
        self._last_step_end = _mark()

    def begin_micro_step(self, per_micro_step):
        if per_micro_step:
            get_accelerator().synchronize()
            self._began = _mark()
            self._forward_s = None
        elif self._step_began is None:
            self._step_began = _mark()

    def end_forward(self):
        """Only for the forward/backward split of per-micro-step timing."""
        if self._began is None:
            return
        get_accelerator().synchronize()
        self._forward_s = _own_since(self._began)

    def end_micro_step(self, size, activations, on_compute=None, split=False):
        """Close the micro-step that ran ``size`` samples. ``on_compute(seconds)`` runs before the
        time is taken (time dilation sleeps there, and the planner must see the slowed device)."""
        if self._began is None:
            if self._step_began is not None:  # per-step timing: the time comes at the step's end
                self._micro_steps.append((size, None, activations))
            return
        get_accelerator().synchronize()
        if on_compute is not None:
            on_compute(_own_since(self._began))
        own = max(_own_since(self._began), 1e-9)
        self._micro_steps.append((size, own, activations))
        if split:
            forward = own if self._forward_s is None else min(max(self._forward_s, 0.0), own)
            self._split.append((forward, own - forward))
        self._began = None
        self._backward_done = _mark()

    def end_step(self):
        overhead = 0.0
        if self._backward_done is not None or self._step_began is not None:
            get_accelerator().synchronize()  # the one synchronisation of a per-step-timed step
        if self._backward_done is not None:
            overhead = max(_own_since(self._backward_done), 0.0)
        micro_steps = self._micro_steps
        untimed = [i for i, (_, t, _) in enumerate(micro_steps) if t is None]
        if untimed:
            share = max(_own_since(self._step_began), 1e-9) / len(untimed)
            for i in untimed:
                size, _, activations = micro_steps[i]
                micro_steps[i] = (size, share, activations)
        now = _mark()
        timing = StepTiming(micro_steps, overhead, now[0] - self._last_step_end[0],
                            now[1] - self._last_step_end[1], self._split)
        self._micro_steps, self._split = [], []
        self._began = self._backward_done = self._step_began = None
        self._last_step_end = now
        return timing

    def restart(self):
        """Forget the marks of a step in progress; the next step's wall time starts now."""
        self._micro_steps, self._split = [], []
        self._began = self._backward_done = self._step_began = None
        self._last_step_end = _mark()


def interval_measurements(steps, agreement_s=0.0):
    """This rank's measurements over a check's interval (``steps``: its ``StepTiming`` list), as
    the controller pools them: every micro-step's sample, the per-micro-step times, the mean
    optimizer overhead and wall time, and each step's wall time. The first step after the last
    agreement carried that agreement's own seconds (``agreement_s``), which are not a step's."""
    count = max(len(steps), 1)
    walls = [step.wall for step in steps]
    if walls:
        walls[0] = max(walls[0] - agreement_s, 0.0)
    return {"samples": [s for step in steps for s in step.samples],
            "step_times": [step.time_per_micro_step for step in steps if step.time_per_micro_step is not None],
            "step_overhead": sum(step.step_overhead for step in steps) / count, "wall": sum(walls) / count,
            "walls": walls}


class StepRecords:
    """The heterogeneous profiler's per-step records (``StepTiming.record``) while it records;
    ``received`` counts are the re-split bytes this rank received in all (input, output)."""

    def __init__(self):
        self.active = False
        self.records = []
        self._received = (0, 0)

    def start(self, received):
        self.records, self.active, self._received = [], True, tuple(received)

    def stop(self):
        self.active = False
        return list(self.records)

    def add(self, timing, step, micro_batch_size, received):
        inputs, outputs = (now - before for now, before in zip(received, self._received))
        self.records.append(timing.record(step, micro_batch_size, inputs, outputs))
        self._received = tuple(received)
