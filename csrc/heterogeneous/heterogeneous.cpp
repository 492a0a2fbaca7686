// SPDX-License-Identifier: Apache-2.0
// deepspeed-hetero native op.
//
// triad_: the STREAM "triad" kernel a = b + scalar * c, in place. The fork times it to measure
// a device's memory bandwidth, one half of the measured score that replaces the spec-sheet
// prior for devices the built-in table does not know (the CPU accelerator among them). A
// hand-written loop is used on the host because torch's own add/mul dispatch adds per-call
// overhead and temporaries that would make the measurement a measurement of the dispatcher.
//
// unscale_maxabs_: the loss scaler's per-step pass over the gradients, fused. Unscaling,
// finding the largest finite magnitude and detecting inf/nan take one read and one write of
// each element (and a second read where inf or nan turns up), where torch's sequence (mul_,
// abs, isfinite, where, max, all) makes six passes and allocates three temporaries the size of
// the gradients. Semantics and the equivalent
// torch sequence: deepspeed/runtime/heterogeneous/native.py.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef DS_HETEROGENEOUS_CUDA
// Defined in heterogeneous_cuda.cu, compiled only by the CUDA builder.
std::tuple<double, bool> unscale_maxabs_cuda(const std::vector<at::Tensor>& tensors, double inv_scale);
#endif

namespace {

void check_operands(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c)
{
    TORCH_CHECK(a.sizes() == b.sizes() && a.sizes() == c.sizes(),
                "heterogeneous.triad_: a, b and c must have the same shape");
    TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.scalar_type() == c.scalar_type(),
                "heterogeneous.triad_: a, b and c must have the same dtype");
    TORCH_CHECK(a.device() == b.device() && a.device() == c.device(),
                "heterogeneous.triad_: a, b and c must live on the same device");
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(),
                "heterogeneous.triad_: a, b and c must be contiguous");
}

template <typename scalar_t>
void triad_host(scalar_t* __restrict__ a,
                const scalar_t* __restrict__ b,
                const scalar_t* __restrict__ c,
                scalar_t scalar,
                int64_t n)
{
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) { a[i] = b[i] + scalar * c[i]; }
}

// ---- unscale_maxabs_ on the host ----------------------------------------------------------
//
// The first pass over a span computes only the largest magnitude, inf and nan included: compared
// as bits, nan > inf > every finite float, so a maximum at or above the dtype's overflow
// threshold reveals a non-finite element. Only then does a second, read-only pass (exact_summary) find
// the finite maximum. Steps that overflow are rare in loss-scaled training (the scaler skips
// them), so the common pass spends no instruction per element on finiteness.
//
// The pass takes the magnitude of the float32 product, before rounding to the tensor's dtype:
// rounding to nearest is monotonic and symmetric, so rounding the maximum gives the maximum of
// the rounded values, and a product becomes inf exactly when its magnitude reaches the
// threshold.

// The bit pattern of a non-negative float orders like its value: the running maximum is an
// unsigned integer maximum, which vectorises without the NaN rules of floating-point compares.
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfinityBits = 0x7F800000u;

// Below this many bytes a thread's start-up costs more than the pass itself.
constexpr int64_t kGrainBytes = int64_t{1} << 18;

struct MaxAbsSummary {
    uint32_t max_abs_bits = 0;  // of the largest finite magnitude; 0 (+0.0) when there is none
    bool nonfinite = false;
};

MaxAbsSummary combine(const MaxAbsSummary& x, const MaxAbsSummary& y)
{
    return {std::max(x.max_abs_bits, y.max_abs_bits), x.nonfinite || y.nonfinite};
}

uint32_t magnitude_bits(float value) { return c10::bit_cast<uint32_t>(value) & kAbsMask; }

// How one dtype is read as float32 and written back. Rounding goes through c10's conversions,
// the ones torch's mul_ uses, so the written bits are torch's. kOverflowBits: the smallest
// float32 magnitude that rounds to inf in the dtype.
struct FloatCodec {
    using storage_t = float;
    static constexpr uint32_t kOverflowBits = kInfinityBits;
    static float widen(float value) { return value; }
    static float narrow(float value) { return value; }
};

struct BFloat16Codec {
    // The raw bits rather than c10::BFloat16: GCC does not vectorise copies of the struct.
    using storage_t = uint16_t;
    // Halfway between the largest bfloat16 (0x7F7F) and 2^128; the tie rounds to even: inf.
    static constexpr uint32_t kOverflowBits = 0x7F7F8000u;
    static float widen(uint16_t bits) { return c10::detail::f32_from_bits(bits); }
    static uint16_t narrow(float value) { return c10::detail::round_to_nearest_even(value); }
};

struct HalfCodec {
    using storage_t = c10::Half;
    // 65520: halfway between the largest float16 (65504) and 65536; the tie rounds to even: inf.
    static constexpr uint32_t kOverflowBits = 0x477FF000u;
    static float widen(c10::Half value) { return static_cast<float>(value); }
    static c10::Half narrow(float value) { return static_cast<c10::Half>(value); }
};

// The largest magnitude of the n elements (with kWrite: of their products by inv_scale, which
// are stored). GCC vectorises this loop for float32 and bfloat16.
template <typename Codec, bool kWrite>
uint32_t max_magnitude_elementwise(typename Codec::storage_t* __restrict__ data, int64_t n, float inv_scale)
{
    uint32_t max_bits = 0;
    for (int64_t i = 0; i < n; ++i) {
        float value = Codec::widen(data[i]);
        if constexpr (kWrite) {
            value *= inv_scale;
            data[i] = Codec::narrow(value);
        }
        max_bits = std::max(max_bits, magnitude_bits(value));
    }
    return max_bits;
}

// bfloat16, written: the vectorised elementwise loop spends a third of its time widening
// 16-bit lanes to 32 and packing them back. Taking the elements in pairs, as the two halves of
// a 32-bit word, needs no shuffle: the high one is a float with its low bits cleared, the low
// one a float shifted up.
uint32_t max_magnitude_bfloat16_pairs(uint16_t* __restrict__ data, int64_t n, float inv_scale)
{
    uint32_t max_bits = 0;
    for (int64_t i = 0; i + 2 <= n; i += 2) {
        uint32_t word;
        std::memcpy(&word, data + i, sizeof(word));  // each half goes back where it came from
        const float low = c10::detail::f32_from_bits(static_cast<uint16_t>(word)) * inv_scale;
        const float high = c10::detail::f32_from_bits(static_cast<uint16_t>(word >> 16)) * inv_scale;
        word = (uint32_t{c10::detail::round_to_nearest_even(high)} << 16) | c10::detail::round_to_nearest_even(low);
        std::memcpy(data + i, &word, sizeof(word));
        max_bits = std::max({max_bits, magnitude_bits(low), magnitude_bits(high)});
    }
    const int64_t done = n - n % 2;
    return std::max(max_bits,
                    max_magnitude_elementwise<BFloat16Codec, true>(data + done, n - done, inv_scale));
}

#if defined(__AVX2__) && defined(__F16C__)
// float16: GCC does not vectorise float <-> half conversions, so F16C by hand, eight elements
// at a time. These are the instructions (round to nearest even) of torch's own AVX2 kernels
// and of c10::Half on x86, hence the same bits.
template <bool kWrite>
uint32_t max_magnitude_half_f16c(c10::Half* data, int64_t n, float inv_scale)
{
    const __m256 scale = _mm256_set1_ps(inv_scale);
    const __m256i abs_mask = _mm256_set1_epi32(static_cast<int>(kAbsMask));
    __m256i max_bits = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        auto* lanes = reinterpret_cast<__m128i*>(data + i);
        __m256 value = _mm256_cvtph_ps(_mm_loadu_si128(lanes));
        if constexpr (kWrite) {
            value = _mm256_mul_ps(value, scale);
            _mm_storeu_si128(lanes, _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
        }
        max_bits = _mm256_max_epu32(max_bits, _mm256_and_si256(_mm256_castps_si256(value), abs_mask));
    }
    alignas(32) uint32_t lane_max[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_max), max_bits);
    return std::max(*std::max_element(lane_max, lane_max + 8),
                    max_magnitude_elementwise<HalfCodec, kWrite>(data + i, n - i, inv_scale));
}
#endif

template <typename Codec, bool kWrite>
uint32_t max_magnitude(typename Codec::storage_t* data, int64_t n, float inv_scale)
{
    if constexpr (std::is_same_v<Codec, BFloat16Codec> && kWrite) {
        return max_magnitude_bfloat16_pairs(data, n, inv_scale);
#if defined(__AVX2__) && defined(__F16C__)
    } else if constexpr (std::is_same_v<Codec, HalfCodec>) {
        return max_magnitude_half_f16c<kWrite>(data, n, inv_scale);
#endif
    } else {
        return max_magnitude_elementwise<Codec, kWrite>(data, n, inv_scale);
    }
}

// The second pass, over the stored values, when the first found a non-finite one.
template <typename Codec>
MaxAbsSummary exact_summary(const typename Codec::storage_t* data, int64_t n)
{
    MaxAbsSummary summary;
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t magnitude = magnitude_bits(Codec::widen(data[i]));
        if (magnitude < kInfinityBits) {
            summary.max_abs_bits = std::max(summary.max_abs_bits, magnitude);
        } else {
            summary.nonfinite = true;
        }
    }
    return summary;
}

template <typename Codec, bool kWrite>
MaxAbsSummary unscale_span(typename Codec::storage_t* data, int64_t n, float inv_scale)
{
    const uint32_t max_bits = max_magnitude<Codec, kWrite>(data, n, inv_scale);
    if (max_bits >= Codec::kOverflowBits) { return exact_summary<Codec>(data, n); }
    const float rounded = Codec::widen(Codec::narrow(c10::bit_cast<float>(max_bits)));
    return {c10::bit_cast<uint32_t>(rounded), false};
}

template <bool kWrite>
MaxAbsSummary unscale_elements(const at::Tensor& tensor, int64_t first, int64_t last, float inv_scale)
{
    const int64_t n = last - first;
    switch (tensor.scalar_type()) {
        case at::kFloat:
            return unscale_span<FloatCodec, kWrite>(tensor.data_ptr<float>() + first, n, inv_scale);
        case at::kBFloat16:
            return unscale_span<BFloat16Codec, kWrite>(
                reinterpret_cast<uint16_t*>(tensor.data_ptr<at::BFloat16>()) + first, n, inv_scale);
        case at::kHalf: return unscale_span<HalfCodec, kWrite>(tensor.data_ptr<at::Half>() + first, n, inv_scale);
        default: TORCH_CHECK(false, "heterogeneous.unscale_maxabs_: unexpected dtype ", tensor.scalar_type());
    }
}

// The tensors are treated as one concatenated byte range, split evenly among the threads: a
// 200M-element tensor is shared by all of them, thousands of small ones cost one parallel
// region, and a mixed list is balanced by bytes moved, not elements (the pass is memory bound).
// An element belongs to the thread whose range holds its first byte.
std::tuple<double, bool> unscale_maxabs_host(const std::vector<at::Tensor>& tensors, double inv_scale)
{
    std::vector<int64_t> first_byte{0};
    first_byte.reserve(tensors.size() + 1);
    for (const auto& tensor : tensors) { first_byte.push_back(first_byte.back() + tensor.nbytes()); }
    const bool write = inv_scale != 1.0;
    // torch multiplies by the scalar converted to float32, for float16 and bfloat16 too.
    const auto scale = static_cast<float>(inv_scale);

    auto unscale_bytes = [&](int64_t begin, int64_t end, MaxAbsSummary summary) {
        auto k = static_cast<size_t>(std::upper_bound(first_byte.begin(), first_byte.end(), begin) -
                                     first_byte.begin() - 1);
        for (; k < tensors.size() && first_byte[k] < end; ++k) {
            const int64_t size = tensors[k].element_size();
            const auto first_element = [&](int64_t byte) {
                return std::clamp((byte - first_byte[k] + size - 1) / size, int64_t{0}, tensors[k].numel());
            };
            const int64_t first = first_element(begin), last = first_element(end);
            if (first < last) {
                summary = combine(summary, write ? unscale_elements<true>(tensors[k], first, last, scale)
                                                 : unscale_elements<false>(tensors[k], first, last, scale));
            }
        }
        return summary;
    };
    const MaxAbsSummary summary =
        at::parallel_reduce(0, first_byte.back(), kGrainBytes, MaxAbsSummary{}, unscale_bytes, combine);
    return {static_cast<double>(c10::bit_cast<float>(summary.max_abs_bits)), summary.nonfinite};
}

// ---- unscale_maxabs_: dispatch -------------------------------------------------------------

// A tensor that requires grad takes the ATen sequence too, whose mul_ autograd records (or
// refuses, for a leaf) as it would in Python; the kernels write behind autograd's back.
bool has_fused_kernel(const at::Tensor& tensor)
{
    const auto dtype = tensor.scalar_type();
    if (!(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) || !tensor.is_contiguous() ||
        tensor.requires_grad()) {
        return false;
    }
#ifdef DS_HETEROGENEOUS_CUDA
    if (tensor.is_cuda()) { return true; }
#endif
    return tensor.is_cpu();
}

// native.py's torch sequence, written in ATen, for the tensors no kernel here serves: float64,
// strided views, devices without a kernel. at::stack promotes the maxima to a common dtype,
// which holds each of them exactly.
std::tuple<double, bool> unscale_maxabs_aten(const std::vector<at::Tensor>& tensors, double inv_scale)
{
    std::vector<at::Tensor> maxima, nonfinite;
    for (const auto& tensor : tensors) {
        if (inv_scale != 1.0) { tensor.mul_(inv_scale); }
        const at::Tensor magnitude = tensor.abs();
        const at::Tensor finite = at::isfinite(magnitude);
        maxima.push_back(at::where(finite, magnitude, 0).max());
        nonfinite.push_back(finite.all().logical_not());
    }
    return {at::stack(maxima).max().item<double>(), at::stack(nonfinite).any().item<bool>()};
}

}  // namespace

at::Tensor triad_(at::Tensor a, const at::Tensor& b, const at::Tensor& c, double scalar)
{
    check_operands(a, b, c);
    if (!a.device().is_cpu()) {
        // Accelerators run ATen's fused kernel: one launch, no temporary.
        at::add_out(a, b, c, scalar);
        return a;
    }
    switch (a.scalar_type()) {
        case at::kFloat:
            triad_host<float>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                              static_cast<float>(scalar), a.numel());
            break;
        case at::kDouble:
            triad_host<double>(a.data_ptr<double>(), b.data_ptr<double>(), c.data_ptr<double>(),
                               scalar, a.numel());
            break;
        default: TORCH_CHECK(false, "heterogeneous.triad_: float32 or float64 expected, got ", a.scalar_type());
    }
    return a;
}

std::tuple<double, bool> unscale_maxabs_(const std::vector<at::Tensor>& tensors, double inv_scale)
{
    std::vector<at::Tensor> fused, composite;
    for (size_t k = 0; k < tensors.size(); ++k) {
        const at::Tensor& tensor = tensors[k];
        TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), "heterogeneous.unscale_maxabs_: tensor ", k, " is ",
                    tensor.scalar_type(), "; floating-point tensors expected");
        TORCH_CHECK(tensor.device() == tensors.front().device(), "heterogeneous.unscale_maxabs_: tensor ", k,
                    " is on ", tensor.device(), ", tensor 0 on ", tensors.front().device(),
                    "; one call takes tensors of one device");
        if (tensor.numel() > 0) { (has_fused_kernel(tensor) ? fused : composite).push_back(tensor); }
    }
    std::tuple<double, bool> result{0.0, false};
    if (!fused.empty()) {
        if (inv_scale != 1.0) {
            // As mul_ does, so that autograd refuses a saved tensor this call modifies. Before the
            // writes: an inference tensor outside inference mode raises here, unmodified.
            for (const auto& tensor : fused) { torch::autograd::impl::bump_version(tensor); }
        }
#ifdef DS_HETEROGENEOUS_CUDA
        result = fused.front().is_cuda() ? unscale_maxabs_cuda(fused, inv_scale)
                                         : unscale_maxabs_host(fused, inv_scale);
#else
        result = unscale_maxabs_host(fused, inv_scale);
#endif
    }
    if (!composite.empty()) {
        const auto [max_abs, nonfinite] = unscale_maxabs_aten(composite, inv_scale);
        result = {std::max(std::get<0>(result), max_abs), std::get<1>(result) || nonfinite};
    }
    return result;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("triad_", &triad_, "a = b + scalar * c in place (STREAM triad); returns a",
          py::arg("a"), py::arg("b"), py::arg("c"), py::arg("scalar"));
    m.def("unscale_maxabs_", &unscale_maxabs_,
          "Multiply floating-point tensors of one device by inv_scale in place (no writes when it "
          "is 1) and return (largest finite magnitude after the multiply, whether any element is "
          "inf or nan); see deepspeed/runtime/heterogeneous/native.py",
          py::arg("tensors"), py::arg("inv_scale"),
          // The pass is long and touches no Python object: let other Python threads run.
          py::call_guard<py::gil_scoped_release>());
}
