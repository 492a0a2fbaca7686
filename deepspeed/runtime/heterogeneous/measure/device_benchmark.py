# SPDX-License-Identifier: Apache-2.0
"""A short benchmark that scores a device the datasheet table does not know (the CPU included).

The score is in TFLOP/s, like the table's rates, so that measured and datasheet scores can sit
side by side in one plan; profiling on the real model replaces both later (docs/balancing.md, "The start-up plan").
"""

import statistics
import time
from dataclasses import dataclass

import torch

from deepspeed.accelerator import get_accelerator

from .native import triad_

# One score is the median of this many short measurements that share the budget: on a shared
# machine a single measurement varied 3.7x between runs of the same host, and the median of a
# few, with their spread shown, says how far to trust it.
_REPEATS = 5
_SMALL_MATMUL, _LARGE_MATMUL = 512, 1024
_TRIAD_ELEMENTS = 1 << 24  # 64 MiB per fp32 operand: well past any cache
# Share of the budget for the matmul; the copy benchmark gets the rest.
_MATMUL_SHARE = 0.7
# A training step is mostly matmuls, but norms, activations and the optimizer stream memory. We
# charge the matmul FLOPs at this many FLOPs per byte moved so that a device with fast arithmetic
# and starved memory is not overrated. It is a prior only; profiling on the model replaces it.
_STEP_FLOPS_PER_BYTE = 100.0


@dataclass(frozen=True)
class MeasuredScore:
    """A device's measured score and how noisy its measurement was."""

    score: float
    """Median of the repeats, in TFLOP/s."""
    repeats: int
    spread: float
    """Half the range of the repeats' scores, relative to the median (0.1: within about ±10%)."""

    def describe(self):
        return f"median of {self.repeats}, spread ±{100 * self.spread:.0f}%"


_measured_scores = {}


def _synchronize():
    get_accelerator().synchronize()


def _calls_per_run(step, seconds):
    """Warm `step` up (allocation, kernel selection, page faults) and return how many calls one
    timed run of about `seconds` makes: batching calls makes launch and synchronisation costs
    vanish on a fast device, while a slow one still times whole calls."""
    start = time.perf_counter()
    step()
    _synchronize()
    return max(1, int(seconds / (time.perf_counter() - start)))


def _rate(step, work, calls):
    """Work units per second of one timed run of `calls` calls of `step`."""
    start = time.perf_counter()
    for _ in range(calls):
        step()
    _synchronize()
    return work * calls / (time.perf_counter() - start)


def _matmul_step(device, seconds):
    """(step, FLOPs per call): an fp32 matmul sized for measurements totalling about `seconds`."""
    size = _SMALL_MATMUL
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    start = time.perf_counter()
    torch.mm(a, b)
    _synchronize()
    # A 512 matmul leaves a fast device idle; take the 8x larger one when it fits the budget.
    if (time.perf_counter() - start) * 8 * 3 < seconds:
        size = _LARGE_MATMUL
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
    out = torch.empty(size, size, device=device)
    return (lambda: torch.mm(a, b, out=out)), 2 * size**3


def _triad_step(device):
    """(step, bytes moved per call): the STREAM triad a = b + s * c, two reads and one write per
    element, with the fork's native kernel where it loads (vectorised loops stream host memory
    closer to what the hardware sustains than torch's elementwise kernel)."""
    a = torch.empty(_TRIAD_ELEMENTS, device=device)
    b = torch.rand(_TRIAD_ELEMENTS, device=device)
    c = torch.rand(_TRIAD_ELEMENTS, device=device)
    return (lambda: triad_(a, b, c, 3.0)), 3 * a.element_size() * _TRIAD_ELEMENTS


def measure_device_score_with_spread(device=None, seconds_budget=0.5):
    """Measured speed of a device in TFLOP/s, comparable with `spec_score` of a known one, with
    the noise of its measurement (a MeasuredScore).

    Times fp32 matmuls (512 or 1024 square) and a STREAM triad on the device, and combines them
    as the effective FLOP rate of a step that moves one byte per `_STEP_FLOPS_PER_BYTE` FLOPs.
    This is repeated `_REPEATS` times within the budget and the median kept. The result is cached
    per device for the life of the process.

    Args:
        device: a torch device or its name. Default None: the accelerator's current device.
        seconds_budget: rough wall-clock budget of the timed runs (default 0.5 s).
    """
    device = torch.device(device if device is not None else get_accelerator().current_device_name())
    key = str(device)
    if key not in _measured_scores:
        matmul_seconds = seconds_budget * _MATMUL_SHARE / _REPEATS
        copy_seconds = seconds_budget * (1 - _MATMUL_SHARE) / _REPEATS
        # The matmul's size is chosen for the whole budget: a larger one runs nearer peak.
        matmul, flops = _matmul_step(device, seconds_budget * _MATMUL_SHARE)
        triad, moved_bytes = _triad_step(device)
        matmul_calls, triad_calls = _calls_per_run(matmul, matmul_seconds), _calls_per_run(triad, copy_seconds)
        scores = []
        for _ in range(_REPEATS):
            matmul_tflops = _rate(matmul, flops, matmul_calls) / 1e12
            memory_tflops = _rate(triad, moved_bytes, triad_calls) / 1e9 * _STEP_FLOPS_PER_BYTE / 1e3
            scores.append(1.0 / (1.0 / matmul_tflops + 1.0 / memory_tflops))
        median = statistics.median(scores)
        _measured_scores[key] = MeasuredScore(median, _REPEATS, (max(scores) - min(scores)) / (2 * median))
    return _measured_scores[key]


def measure_device_score(device=None, seconds_budget=0.5):
    """The score of `measure_device_score_with_spread` alone, in TFLOP/s (same arguments)."""
    return measure_device_score_with_spread(device, seconds_budget).score


def measured_score(device):
    """The MeasuredScore cached for `device` (a torch device or its name), or None when it was
    not measured in this process."""
    return _measured_scores.get(str(torch.device(device)))
