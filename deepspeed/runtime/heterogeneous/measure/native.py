# SPDX-License-Identifier: Apache-2.0
"""The fork's native op (``csrc/heterogeneous``), loaded through the upstream op builder.

The op is prebuilt by ``--heterogeneous-support`` or JIT-built on first use; where neither is
possible (no compiler, no ninja) every function here falls back to torch with the same result,
and ``native_op_status()`` says which path is in use.
"""

import time

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

_BUILDER_NAME = "HeterogeneousBuilder"
_state = {"op": None, "error": None, "tried": False}


def load_native_op():
    """The loaded extension module, or None (the reason is kept for ``native_op_status``)."""
    if not _state["tried"]:
        _state["tried"] = True
        try:
            builder = get_accelerator().create_op_builder(_BUILDER_NAME)
            if builder is None or type(builder).__name__ != _BUILDER_NAME:
                raise RuntimeError(f"the {get_accelerator().device_name()} accelerator has no {_BUILDER_NAME}")
            _state["op"] = builder.load(verbose=False)
        except Exception as exc:  # a missing compiler must not stop training: torch takes over
            _state["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning(f"deepspeed-hetero native op unavailable, using torch fallbacks ({_state['error']})")
    return _state["op"]


def native_op_status():
    """'prebuilt', 'jit' or 'unavailable: <reason>' for reports."""
    op = load_native_op()
    if op is None:
        return f"unavailable: {_state['error']}"
    try:
        from deepspeed.git_version_info import installed_ops
        return "prebuilt" if installed_ops.get("heterogeneous") else "jit"
    except ImportError:
        return "jit"


def triad_(a, b, c, scalar):
    """``a = b + scalar * c`` in place (the STREAM triad); returns ``a``."""
    op = load_native_op()
    if op is not None and a.dtype in (torch.float32, torch.float64):
        return op.triad_(a, b, c, float(scalar))
    return torch.add(b, c, alpha=scalar, out=a)


def unscale_maxabs_(tensors, inv_scale):
    """Unscale gradients in place and report what a dynamic loss scaler needs, in one pass.

    Args:
        tensors: floating-point tensors of one device (typically the gradients); empty tensors
            and an empty list are allowed.
        inv_scale: the multiplier (1 / loss scale). At exactly 1.0 nothing is written.

    Returns:
        ``(max_abs, found_nonfinite)``: the largest ``|x|`` over the finite elements after the
        multiply, as a Python float (0.0 when there are none), and whether any element is inf or
        nan after the multiply. A non-finite element does not stop the pass: every tensor is still
        scaled, and ``max_abs`` still covers the finite ones. ``found_nonfinite`` also reports a
        finite value that the multiply (``inv_scale > 1``) or the rounding to float16/bfloat16
        overflows to inf.

    The result equals ``unscale_maxabs_reference_`` (torch's unfused sequence) bit for bit: each
    element becomes ``t.mul_(inv_scale)``'s value; for float32, float16 and bfloat16 that is the
    float32 product with ``inv_scale`` rounded to float32, rounded once to the tensor's dtype,
    denormals kept. Only nan bits may differ (torch itself writes different bfloat16 nan bits in
    its vector and scalar loops). Contiguous float32, float16 and bfloat16 tensors on the CPU,
    and on CUDA where the op was built with its CUDA kernel, take the fused pass; the native op
    runs the torch sequence on the others (float64, strided views, other devices).
    """
    op = load_native_op()
    if op is None:
        return unscale_maxabs_reference_(tensors, inv_scale)
    return op.unscale_maxabs_(list(tensors), float(inv_scale))


def unscale_maxabs_reference_(tensors, inv_scale):
    """``unscale_maxabs_`` as torch's unfused sequence: the fallback, and the reference for tests."""
    maxima, nonfinite = [], []
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        if inv_scale != 1.0:
            tensor.mul_(inv_scale)
        magnitude = tensor.abs()
        finite = torch.isfinite(magnitude)
        maxima.append(torch.where(finite, magnitude, 0).max())
        nonfinite.append(~finite.all())
    if not maxima:
        return 0.0, False
    # stack promotes the maxima to a dtype that holds each of them exactly.
    return torch.stack(maxima).max().item(), bool(torch.stack(nonfinite).any().item())


def stream_triad_gbps(n_elems=1 << 24, repeats=5, device=None):
    """Memory bandwidth of ``device`` (default: the current accelerator) in GB/s, best of ``repeats``.

    Three arrays of ``n_elems`` float32 are touched per pass (two reads, one write), as in STREAM.
    """
    device = get_accelerator().current_device_name() if device is None else device
    a = torch.empty(n_elems, dtype=torch.float32, device=device)
    b = torch.rand(n_elems, dtype=torch.float32, device=device)
    c = torch.rand(n_elems, dtype=torch.float32, device=device)
    triad_(a, b, c, 3.0)  # warm-up: page faults and the first launch are not bandwidth
    best = float("inf")
    for _ in range(max(1, repeats)):
        get_accelerator().synchronize()
        start = time.perf_counter()
        triad_(a, b, c, 3.0)
        get_accelerator().synchronize()
        best = min(best, time.perf_counter() - start)
    return 3 * n_elems * a.element_size() / best / 1e9
