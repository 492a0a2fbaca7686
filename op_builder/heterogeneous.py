# SPDX-License-Identifier: Apache-2.0
"""Builder of the fork's native op for CUDA/ROCm, found by upstream's op-builder discovery.

The same source serves both accelerators: on device tensors it dispatches to ATen kernels.
"""

import os

from .builder import CUDAOpBuilder

SOURCE = "csrc/heterogeneous/heterogeneous.cpp"


class HeterogeneousBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_HETEROGENEOUS"
    NAME = "heterogeneous"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"deepspeed.ops.heterogeneous.{self.NAME}_op"

    def sources(self):
        if self.jit_mode:
            # One absolute path whichever copy of op_builder/ loads this builder (the tree links
            # deepspeed/ops/csrc/heterogeneous to csrc/heterogeneous): ninja recompiles whenever a
            # source path in its build file changes.
            return [os.path.realpath(self.deepspeed_src_path(SOURCE))]
        return [SOURCE]

    def include_paths(self):
        return []

    def cxx_args(self):
        return super().cxx_args() + ["-fopenmp"]

    def extra_ldflags(self):
        return ["-fopenmp"]
