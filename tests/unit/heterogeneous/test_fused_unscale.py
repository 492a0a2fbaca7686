# SPDX-License-Identifier: Apache-2.0
"""The native fused unscale (``unscale_maxabs_``) equals torch's unfused sequence bit for bit."""

import itertools

import pytest
import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure import native

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# 1.0 writes nothing; 2**-16 is a typical loss scale; 0.3 is not a power of two, so products are
# rounded; 3.0 overflows the largest values.
INV_SCALES = [1.0, 2.0**-16, 0.3, 3.0]
BIT_VIEWS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16
}


@pytest.fixture(scope="module")
def op():
    # A silent fallback would make every test here compare torch with torch.
    loaded = native.load_native_op()
    assert loaded is not None, native.native_op_status()
    return loaded


@pytest.fixture
def threads():
    """Run a test body with a given torch thread count, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def gradient(size, dtype, seed, specials=True):
    """Values over the dtype's whole range, signs, zeros and subnormals; with ``specials``, also
    +inf, -inf and nan, and the dtype's largest finite values (which 3.0 overflows)."""
    generator = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    low, high = finfo.smallest_normal, finfo.max / 8
    exponents = torch.randint(int(torch.log2(torch.tensor(low))) - 8, int(torch.log2(torch.tensor(high))),
                              (size, ), generator=generator)
    values = torch.randn(size, generator=generator) * torch.exp2(exponents.float())
    values = values.clamp(-high, high).to(dtype)
    picks = torch.randint(0, 16, (size, ), generator=generator)
    values[picks == 0] = 0.0
    values[picks == 1] = -0.0
    values[picks == 2] = -finfo.tiny / 4  # subnormal
    values[picks == 3] = 1e-40 if dtype == torch.float32 else finfo.tiny / 64  # deep subnormal
    if specials:
        values[picks == 4] = float("inf")
        values[picks == 5] = -float("inf")
        values[picks == 6] = float("nan")
        values[picks == 7] = -finfo.max
        values[picks == 8] = finfo.max / 2
    return values


def assert_same_bits(actual, expected):
    """Bitwise equal, except that a nan only has to be a nan (torch's own kernels do not agree on
    the bits of a bfloat16 nan)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    bits = BIT_VIEWS[actual.dtype]
    mismatch = (actual.view(bits) != expected.view(bits)) & ~nan
    assert not mismatch.any(), f"{int(mismatch.sum())} elements differ, first at {mismatch.nonzero()[0].item()}"


def assert_matches_reference(op, tensors, inv_scale):
    """Run the native op and the torch reference on copies; compare tensors and results."""
    fused = [t.clone() for t in tensors]
    reference = [t.clone() for t in tensors]
    result = op.unscale_maxabs_(fused, inv_scale)
    expected = native.unscale_maxabs_reference_(reference, inv_scale)
    assert type(result[0]) is float and type(result[1]) is bool
    assert result == expected, (result, expected)
    for actual, wanted in zip(fused, reference):
        assert_same_bits(actual, wanted)
    return result


@pytest.mark.parametrize("specials", [True, False], ids=["with-nonfinite", "finite"])
@pytest.mark.parametrize("inv_scale", INV_SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_bit_for_bit(op, dtype, inv_scale, specials):
    tensors = [gradient(size, dtype, seed, specials) for seed, size in enumerate([0, 1, 7, 1000003])]
    max_abs, found_nonfinite = assert_matches_reference(op, tensors, inv_scale)
    assert found_nonfinite == specials
    assert 0.0 < max_abs < float("inf")


@pytest.mark.skipif(get_accelerator().device_name() == "cpu", reason="needs an accelerator")
@pytest.mark.parametrize("inv_scale", INV_SCALES)
def test_accelerator_tensors_match_torch(op, inv_scale):
    # The device kernel (CUDA) against torch's own device kernels, all dtypes in one call.
    device = get_accelerator().current_device_name()
    cases = list(itertools.product(DTYPES, [0, 1, 7, 1000003]))
    for specials in (True, False):
        tensors = [gradient(size, dtype, seed, specials).to(device) for seed, (dtype, size) in enumerate(cases)]
        assert assert_matches_reference(op, tensors, inv_scale)[1] == specials


@pytest.mark.parametrize("thread_count", [1, 3])
def test_mixed_dtypes_split_across_threads(op, threads, thread_count):
    # 200 tensors of odd sizes and mixed dtypes, several MB in all: the threads' ranges start and
    # end inside tensors, and a range walks across many of them.
    threads(thread_count)
    generator = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 20000, (200, ), generator=generator).tolist()
    tensors = [gradient(size, DTYPES[k % 3], k, specials=k % 50 == 0) for k, size in enumerate(sizes)]
    tensors.insert(100, torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    for inv_scale in (2.0**-16, 0.3, 1.0):
        assert assert_matches_reference(op, tensors, inv_scale)[1]
    finite = [t for t in tensors if torch.isfinite(t).all()]
    assert not assert_matches_reference(op, finite, 0.3)[1]


# factor * inv_scale is exact and lies halfway between the dtype's largest finite value and the
# next power of two (65520 for float16, 511 * 2**119 for bfloat16): the tie rounds to inf.
@pytest.mark.parametrize("dtype, factor, inv_scale", [(torch.float16, 7280.0, 9.0),
                                                      (torch.bfloat16, 73 * 2.0**119, 7.0)],
                         ids=["float16", "bfloat16"])
def test_overflow_boundary_of_the_rounding(op, dtype, factor, inv_scale):
    # The op tells overflow from the float32 product, before rounding: the threshold must be the
    # rounding's, on both sides of it.
    at = torch.tensor([factor], dtype=dtype)
    below = at.nextafter(torch.zeros(1, dtype=dtype))
    above = at.nextafter(torch.full((1, ), float("inf"), dtype=dtype))
    assert torch.isinf((at.float() * inv_scale).to(dtype)).all()
    for tensor, overflows in ((below, False), (-below, False), (at, True), (-at, True), (above, True)):
        max_abs, found_nonfinite = assert_matches_reference(op, [tensor], inv_scale)
        assert found_nonfinite == overflows and (max_abs == 0.0) == overflows


def test_unit_scale_writes_nothing(op):
    tensor = gradient(4099, torch.bfloat16, 3)
    tensor.view(torch.int16)[0] = -1  # a nan whose bits a multiply by 1.0 would change
    before = tensor.clone()
    op.unscale_maxabs_([tensor], 1.0)
    assert torch.equal(tensor.view(torch.int16), before.view(torch.int16))


def test_edge_cases(op):
    assert op.unscale_maxabs_([], 0.5) == (0.0, False)
    assert op.unscale_maxabs_([torch.empty(0), torch.empty(0, dtype=torch.float16)], 0.5) == (0.0, False)
    nonfinite = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert op.unscale_maxabs_([nonfinite], 0.5) == (0.0, True)
    assert op.unscale_maxabs_([torch.tensor([-0.0, 0.0])], 0.5) == (0.0, False)
    assert op.unscale_maxabs_([torch.tensor([-4.0, 2.0])], 0.5) == (2.0, False)


def test_tensors_without_a_kernel_take_the_torch_sequence(op):
    # Strided views and float64 (here beyond float32's range) go through ATen in the same call.
    tensors = [
        gradient(2000, torch.float16, 3)[::2],
        torch.tensor([-3e300, 2.0, float("inf")], dtype=torch.float64),
        gradient(1000, torch.bfloat16, 4),
    ]
    max_abs, found_nonfinite = assert_matches_reference(op, tensors, 0.5)
    assert max_abs == 1.5e300 and found_nonfinite


def test_autograd_sees_the_in_place_write_as_after_mul_(op):
    tensor = gradient(100, torch.float32, 5)
    version = tensor._version
    op.unscale_maxabs_([tensor], 1.0)
    assert tensor._version == version, "nothing written"
    op.unscale_maxabs_([tensor], 0.5)
    assert tensor._version > version
    # Tensors that require grad go through mul_ itself: recorded, or refused for a leaf.
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        op.unscale_maxabs_([leaf], 0.5)
    scaled = leaf * 4
    assert op.unscale_maxabs_([scaled], 0.5) == (2.0, False)
    scaled.sum().backward()
    assert torch.equal(leaf.grad, torch.full((3, ), 2.0))


def test_bad_inputs_are_refused_with_a_message(op):
    with pytest.raises(RuntimeError, match="unscale_maxabs_: tensor 1 is Int; floating-point tensors expected"):
        op.unscale_maxabs_([torch.ones(4), torch.ones(4, dtype=torch.int32)], 0.5)
    with pytest.raises(RuntimeError, match="tensor 1 is on meta, tensor 0 on cpu; one call takes tensors of one"):
        op.unscale_maxabs_([torch.ones(4), torch.ones(4, device="meta")], 0.5)


def test_python_entry_point_runs_the_op(op, monkeypatch):
    tensors = [gradient(1000, torch.bfloat16, 1), gradient(999, torch.float32, 2)]
    expected = native.unscale_maxabs_reference_([t.clone() for t in tensors], 2.0**-10)

    def no_fallback(*args):
        raise AssertionError("the torch fallback ran although the op is loaded")

    monkeypatch.setattr(native, "unscale_maxabs_reference_", no_fallback)
    assert native.unscale_maxabs_(iter(tensors), 2.0**-10) == expected  # any iterable of tensors
