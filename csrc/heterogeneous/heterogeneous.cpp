// SPDX-License-Identifier: Apache-2.0
// deepspeed-hetero native op.
//
// triad_: the STREAM "triad" kernel a = b + scalar * c, in place. The fork times it to measure
// a device's memory bandwidth, one half of the measured score that replaces the spec-sheet
// prior for devices the built-in table does not know (the CPU accelerator among them). A
// hand-written loop is used on the host because torch's own add/mul dispatch adds per-call
// overhead and temporaries that would make the measurement a measurement of the dispatcher.

#include <torch/extension.h>

#include <cstdint>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("triad_", &triad_, "a = b + scalar * c in place (STREAM triad); returns a",
          py::arg("a"), py::arg("b"), py::arg("c"), py::arg("scalar"));
}
