# SPDX-License-Identifier: Apache-2.0
"""Builder of the fork's native op for the CPU accelerator.

Prebuilt by ``pip install . --config-settings="--build-option=--heterogeneous-support"`` (or
DS_BUILD_HETEROGENEOUS=1); otherwise JIT-built with ninja on first use.
"""

import os

from .builder import CPUOpBuilder

SOURCE = "csrc/heterogeneous/heterogeneous.cpp"


class HeterogeneousBuilder(CPUOpBuilder):
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

    def libraries_args(self):
        return []
