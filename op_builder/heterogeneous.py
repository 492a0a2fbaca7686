# SPDX-License-Identifier: Apache-2.0
"""Builders of the fork's native op. ``HeterogeneousBuilder`` here is the CUDA/ROCm one, found by
upstream's op-builder discovery; the CPU accelerator's is in ``cpu/heterogeneous.py``. The same
source serves both: on device tensors it dispatches to ATen kernels.
"""

import os

from .builder import CUDAOpBuilder

SOURCE = "csrc/heterogeneous/heterogeneous.cpp"


class HeterogeneousOpSpec:
    """What every accelerator's builder of the op shares: name, build flag, module and sources."""

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


class HeterogeneousBuilder(HeterogeneousOpSpec, CUDAOpBuilder):

    def cxx_args(self):
        return super().cxx_args() + ["-fopenmp"]

    def extra_ldflags(self):
        return ["-fopenmp"]
