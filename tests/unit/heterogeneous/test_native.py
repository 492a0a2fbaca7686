# SPDX-License-Identifier: Apache-2.0
"""The fork's native op: it must build (prebuilt or JIT) and agree with torch."""

import time
from types import SimpleNamespace

import pytest
import torch

from deepspeed.runtime.heterogeneous.measure import native


def test_the_op_loads_through_the_upstream_builder():
    # A silent fallback would make every other test here compare torch with torch.
    assert native.native_op_status() in ("prebuilt", "jit"), native.native_op_status()
    assert hasattr(native.load_native_op(), "triad_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 17, 4096 + 3])
def test_triad_matches_torch(dtype, size):
    generator = torch.Generator().manual_seed(size)
    b = torch.randn(size, dtype=dtype, generator=generator)
    c = torch.randn(size, dtype=dtype, generator=generator)
    c[::5] = torch.finfo(dtype).tiny / 4  # denormals pass through like any other value
    a = torch.full((size, ), float("nan"), dtype=dtype)
    result = native.load_native_op().triad_(a, b, c, -2.5)
    assert result.data_ptr() == a.data_ptr(), "triad_ works in place"
    # Equal up to rounding: the compiled loop may fuse the multiply-add (one rounding, not two).
    torch.testing.assert_close(a, b + (-2.5) * c)


def test_triad_rejects_bad_operands_with_a_message():
    op = native.load_native_op()
    with pytest.raises(RuntimeError, match="same shape"):
        op.triad_(torch.empty(4), torch.empty(5), torch.empty(4), 1.0)
    with pytest.raises(RuntimeError, match="same dtype"):
        op.triad_(torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4), 1.0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        op.triad_(*(torch.empty(4, dtype=torch.int32) for _ in range(3)), 1.0)


def test_bandwidth_is_three_arrays_over_the_fastest_timed_pass(monkeypatch):
    """With a clock that advances only inside the triad, by known amounts, the result is exact:
    3 float32 arrays of ``n_elems`` over the fastest timed pass, the untimed warm-up left out."""
    n_elems, pass_seconds = 1000, [100.0, 0.5, 0.25, 0.4375]  # warm-up first
    clock, passes = [0.0], []
    real_triad = native.triad_

    def timed_triad(a, b, c, scalar):
        passes.append((a.numel(), b.numel(), c.numel(), a.dtype, a.device.type))
        result = real_triad(a, b, c, scalar)
        torch.testing.assert_close(a, b + scalar * c)  # each timed pass does the work it is credited with
        clock[0] += pass_seconds[len(passes) - 1]
        return result

    monkeypatch.setattr(native, "triad_", timed_triad)
    monkeypatch.setattr(native, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    gbps = native.stream_triad_gbps(n_elems=n_elems, repeats=3, device="cpu")
    assert passes == [(n_elems, n_elems, n_elems, torch.float32, "cpu")] * 4
    assert gbps == pytest.approx(3 * n_elems * 4 / 0.25 / 1e9, rel=1e-12)


def test_measured_bandwidth_fits_the_wall_time_of_the_measurement():
    """On the real clock, bounds that hold however loaded the machine is, and that an error of
    units (a factor of 1000: ms for s, MB for GB) breaks: ``repeats`` timed passes run inside the
    call, so the fastest one, as implied by the result, takes at most the call's time over
    ``repeats``; and it cannot be 100x faster than the best of many passes of the same triad timed
    here (on a loaded machine the op's own figure was seen up to ~100x slower, never faster)."""
    n_elems, repeats = 1 << 20, 3
    start = time.perf_counter()
    gbps = native.stream_triad_gbps(n_elems=n_elems, repeats=repeats, device="cpu")
    elapsed = time.perf_counter() - start
    fastest_pass = 3 * n_elems * 4 / (gbps * 1e9)
    assert fastest_pass <= elapsed / repeats, (gbps, elapsed)
    a, b, c = torch.zeros(n_elems), torch.rand(n_elems), torch.rand(n_elems)
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        native.triad_(a, b, c, 3.0)
        timings.append(time.perf_counter() - start)
    assert min(timings) / 100 <= fastest_pass, (fastest_pass, min(timings))
