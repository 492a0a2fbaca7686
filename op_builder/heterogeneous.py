# SPDX-License-Identifier: Apache-2.0
"""Builder of the fork's native op for CUDA/ROCm, found by upstream's op-builder discovery.

The same source serves both accelerators: on device tensors it dispatches to ATen kernels.
"""

from .builder import CUDAOpBuilder


class HeterogeneousBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_HETEROGENEOUS"
    NAME = "heterogeneous"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"deepspeed.ops.heterogeneous.{self.NAME}_op"

    def sources(self):
        return ["csrc/heterogeneous/heterogeneous.cpp"]

    def include_paths(self):
        return []

    def cxx_args(self):
        return super().cxx_args() + ["-fopenmp"]

    def extra_ldflags(self):
        return ["-fopenmp"]
