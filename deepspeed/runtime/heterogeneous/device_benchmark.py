# SPDX-License-Identifier: Apache-2.0
"""A short benchmark that scores a device the datasheet table does not know (the CPU included).

The score is in TFLOP/s, like the table's rates, so that measured and datasheet scores can sit
side by side in one plan; profiling on the real model replaces both later (docs/architecture.md §4.1).
"""

import time

import torch

from deepspeed.accelerator import get_accelerator

try:
    # The fork's native triad streams host memory with vectorised loops, closer to what the
    # hardware sustains than torch's elementwise kernel; it falls back to torch by itself.
    from .native import stream_triad_gbps as _native_triad
except ImportError:
    _native_triad = None  # a tree without the fork's native module: torch below does the same


_TIMED_RUNS = 3
_SMALL_MATMUL, _LARGE_MATMUL = 512, 1024
_TRIAD_ELEMENTS = 1 << 24  # 64 MiB per fp32 operand: well past any cache
# Share of the budget for the matmul; the copy benchmark gets the rest.
_MATMUL_SHARE = 0.7
# A training step is mostly matmuls, but norms, activations and the optimizer stream memory. We
# charge the matmul FLOPs at this many FLOPs per byte moved so that a device with fast arithmetic
# and starved memory is not overrated. It is a prior only; profiling on the model replaces it.
_STEP_FLOPS_PER_BYTE = 100.0

_measured_scores = {}


def _synchronize():
    get_accelerator().synchronize()


def _best_rate(step, work, seconds):
    """Best rate (work units per second) of `step` in a few timed runs that fit in `seconds`.

    The first call is the warm-up (allocation, kernel selection, page faults) and sizes the runs:
    calls are batched so that launch and synchronisation costs vanish on fast devices, while a
    slow device still gets `_TIMED_RUNS` runs of one call. The best run is kept because on a
    shared machine interference only ever slows a run down.
    """
    start = time.perf_counter()
    step()
    _synchronize()
    single = time.perf_counter() - start
    calls = max(1, int((seconds - single) / (_TIMED_RUNS * single)))
    best = 0.0
    for _ in range(_TIMED_RUNS):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        _synchronize()
        best = max(best, work * calls / (time.perf_counter() - start))
    return best


def _matmul_tflops(device, seconds):
    size = _SMALL_MATMUL
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    start = time.perf_counter()
    torch.mm(a, b)
    _synchronize()
    # A 512 matmul leaves a fast device idle; take the 8x larger one when it fits the budget.
    if (time.perf_counter() - start) * 8 * (_TIMED_RUNS + 2) < seconds:
        size = _LARGE_MATMUL
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
    out = torch.empty(size, size, device=device)
    return _best_rate(lambda: torch.mm(a, b, out=out), 2 * size**3, seconds) / 1e12


def _copy_gbps(device, seconds):
    if _native_triad is not None:
        return _native_triad(_TRIAD_ELEMENTS, _TIMED_RUNS, device=device)
    b = torch.randn(_TRIAD_ELEMENTS, device=device)
    c = torch.randn(_TRIAD_ELEMENTS, device=device)
    a = torch.empty_like(b)
    # STREAM triad a = b + s * c: two reads and one write per element.
    moved_bytes = 3 * a.element_size() * _TRIAD_ELEMENTS
    return _best_rate(lambda: torch.add(b, c, alpha=3.0, out=a), moved_bytes, seconds) / 1e9


def measure_device_score(device=None, seconds_budget=0.5):
    """Measured speed of a device in TFLOP/s, comparable with `spec_score` of a known one.

    Times fp32 matmuls (512 or 1024 square) and a STREAM triad on the device, and combines them
    as the effective FLOP rate of a step that moves one byte per `_STEP_FLOPS_PER_BYTE` FLOPs.
    The result is cached per device for the life of the process.

    Args:
        device: a torch device or its name. Default None: the accelerator's current device.
        seconds_budget: rough wall-clock budget of the whole measurement (default 0.5 s).
    """
    device = torch.device(device if device is not None else get_accelerator().current_device_name())
    key = str(device)
    if key not in _measured_scores:
        matmul_tflops = _matmul_tflops(device, seconds_budget * _MATMUL_SHARE)
        copy_gbps = _copy_gbps(device, seconds_budget * (1 - _MATMUL_SHARE))
        memory_tflops = copy_gbps * _STEP_FLOPS_PER_BYTE / 1e3
        _measured_scores[key] = 1.0 / (1.0 / matmul_tflops + 1.0 / memory_tflops)
    return _measured_scores[key]
