# SPDX-License-Identifier: Apache-2.0
"""The fork's native op: it must build (prebuilt or JIT) and agree with torch."""

import pytest
import torch

from deepspeed.runtime.heterogeneous import native


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


def test_bandwidth_measurement_is_positive():
    gbps = native.stream_triad_gbps(n_elems=1 << 20, repeats=3)
    assert 0.0 < gbps < 1e5
