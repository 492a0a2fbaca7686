// SPDX-License-Identifier: Apache-2.0
// deepspeed-hetero native op: unscale_maxabs_ on CUDA devices (dispatch in heterogeneous.cpp,
// semantics in deepspeed/runtime/heterogeneous/native.py). Compiled only by the CUDA builder,
// which also defines DS_HETEROGENEOUS_CUDA so that heterogeneous.cpp dispatches CUDA tensors here.
//
// Exactness: the element is widened to float, multiplied by the float32 scale and narrowed
// through c10::Half / c10::BFloat16, which is what torch's mul_ kernel does. The builder drops
// --use_fast_math for this op, so the multiply is IEEE with denormals kept, as in torch.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int kThreadsPerBlock = 256;  // a power of two: the block reduction halves it
// Enough resident blocks to saturate memory bandwidth; the grid-stride loop covers the rest.
constexpr int kBlocksPerMultiprocessor = 8;

constexpr unsigned int kAbsMask = 0x7FFFFFFFu;
constexpr unsigned int kInfinityBits = 0x7F800000u;

// Accumulated across the blocks of every launch of one call. The bit pattern of a
// non-negative float orders like its value, so atomicMax on it takes the float maximum.
struct DeviceSummary {
    unsigned int max_abs_bits;
    unsigned int nonfinite;
};

template <typename scalar_t>
__global__ void unscale_maxabs_kernel(scalar_t* __restrict__ data,
                                      int64_t n,
                                      float inv_scale,
                                      bool write,
                                      DeviceSummary* __restrict__ summary)
{
    unsigned int max_abs_bits = 0;
    int nonfinite = 0;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        float value = static_cast<float>(data[i]);
        if (write) {
            const scalar_t rounded = static_cast<scalar_t>(value * inv_scale);
            data[i] = rounded;
            value = static_cast<float>(rounded);  // the magnitude is taken of the value as stored
        }
        const unsigned int magnitude = __float_as_uint(value) & kAbsMask;
        if (magnitude < kInfinityBits) {
            max_abs_bits = magnitude > max_abs_bits ? magnitude : max_abs_bits;
        } else {
            nonfinite = 1;
        }
    }

    __shared__ unsigned int block_max[kThreadsPerBlock];
    block_max[threadIdx.x] = max_abs_bits;
    // A barrier like __syncthreads (block_max is complete after it) that also ORs the flags.
    const int block_nonfinite = __syncthreads_or(nonfinite);
    for (unsigned int half = kThreadsPerBlock / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            const unsigned int other = block_max[threadIdx.x + half];
            if (other > block_max[threadIdx.x]) { block_max[threadIdx.x] = other; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicMax(&summary->max_abs_bits, block_max[0]);
        if (block_nonfinite) { atomicOr(&summary->nonfinite, 1u); }
    }
}

template <typename scalar_t>
void launch(const at::Tensor& tensor, float inv_scale, bool write, DeviceSummary* summary, int max_blocks,
            cudaStream_t stream)
{
    const int64_t n = tensor.numel();
    const int blocks = static_cast<int>(
        std::min<int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, max_blocks));
    unscale_maxabs_kernel<scalar_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
        tensor.data_ptr<scalar_t>(), n, inv_scale, write, summary);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// tensors: non-empty, contiguous, float32/float16/bfloat16, all on one CUDA device (checked by
// the caller in heterogeneous.cpp).
std::tuple<double, bool> unscale_maxabs_cuda(const std::vector<at::Tensor>& tensors, double inv_scale)
{
    const c10::cuda::CUDAGuard device_guard(tensors.front().device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    int multiprocessors = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount,
                                          tensors.front().device().index()));
    const int max_blocks = multiprocessors * kBlocksPerMultiprocessor;
    static_assert(sizeof(DeviceSummary) == 2 * sizeof(int32_t), "DeviceSummary must fit two int32 elements");
    // Zero-filled on the current stream, so ordered before the kernels below.
    const at::Tensor summary_buffer = at::zeros({2}, tensors.front().options().dtype(at::kInt));
    auto* summary = reinterpret_cast<DeviceSummary*>(summary_buffer.data_ptr<int32_t>());

    const bool write = inv_scale != 1.0;
    const auto scale = static_cast<float>(inv_scale);  // as torch converts a Python scalar
    for (const auto& tensor : tensors) {
        switch (tensor.scalar_type()) {
            case at::kFloat: launch<float>(tensor, scale, write, summary, max_blocks, stream); break;
            case at::kHalf: launch<at::Half>(tensor, scale, write, summary, max_blocks, stream); break;
            case at::kBFloat16: launch<at::BFloat16>(tensor, scale, write, summary, max_blocks, stream); break;
            default:
                TORCH_CHECK(false, "heterogeneous.unscale_maxabs_: unexpected dtype ", tensor.scalar_type());
        }
    }
    // The caller wants the numbers now: one copy to the host, which waits for the kernels.
    const at::Tensor host = summary_buffer.cpu();
    const int32_t* values = host.data_ptr<int32_t>();
    const float max_abs = c10::bit_cast<float>(static_cast<uint32_t>(values[0]));
    return {static_cast<double>(max_abs), values[1] != 0};
}
