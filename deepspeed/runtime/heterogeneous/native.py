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
