# SPDX-License-Identifier: Apache-2.0
"""Builders of the fork's native op. ``HeterogeneousBuilder`` here is the CUDA/ROCm one, found by
upstream's op-builder discovery; the CPU accelerator's is in ``cpu/heterogeneous.py``. Both
compile ``heterogeneous.cpp``, whose host loops serve CPU tensors and which dispatches other
device tensors to ATen; the CUDA builder adds the CUDA kernels of ``heterogeneous_cuda.cu``.
"""

import os

from .builder import CUDAOpBuilder

SOURCE = "csrc/heterogeneous/heterogeneous.cpp"
CUDA_SOURCE = "csrc/heterogeneous/heterogeneous_cuda.cu"


class HeterogeneousOpSpec:
    """What every accelerator's builder of the op shares: name, build flag, module and sources."""

    BUILD_VAR = "DS_BUILD_HETEROGENEOUS"
    NAME = "heterogeneous"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"deepspeed.ops.heterogeneous.{self.NAME}_op"

    def source_paths(self, paths):
        if self.jit_mode:
            # One absolute path whichever copy of op_builder/ loads this builder (the tree links
            # deepspeed/ops/csrc/heterogeneous to csrc/heterogeneous): ninja recompiles whenever a
            # source path in its build file changes.
            return [os.path.realpath(self.deepspeed_src_path(path)) for path in paths]
        return list(paths)

    def sources(self):
        return self.source_paths([SOURCE])

    def include_paths(self):
        return []


class HeterogeneousBuilder(HeterogeneousOpSpec, CUDAOpBuilder):

    def sources(self):
        # build_for_cpu is settled before sources and compiler arguments are asked for: torch
        # without CUDA, or a CUDA toolkit that does not match torch's, builds the host code alone.
        return self.source_paths([SOURCE] if self.build_for_cpu else [SOURCE, CUDA_SOURCE])

    def cxx_args(self):
        # -march as upstream's CPU ops use it, so the host loops vectorise for this machine.
        args = super().cxx_args() + [self.cpu_arch(), "-fopenmp"]
        return args if self.build_for_cpu else args + ["-DDS_HETEROGENEOUS_CUDA"]

    def nvcc_args(self):
        # Without fast math: unscale_maxabs_ must produce torch's bits, and --use_fast_math
        # flushes float32 denormals to zero, which torch's own kernels do not.
        return [arg for arg in super().nvcc_args() if arg != "--use_fast_math"]

    def extra_ldflags(self):
        return ["-fopenmp"]
