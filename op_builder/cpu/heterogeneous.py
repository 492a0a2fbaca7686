# SPDX-License-Identifier: Apache-2.0
"""Builder of the fork's native op for the CPU accelerator.

Prebuilt by ``pip install . --config-settings="--build-option=--heterogeneous-support"`` (or
DS_BUILD_HETEROGENEOUS=1); otherwise JIT-built with ninja on first use.
"""

from .builder import CPUOpBuilder


class HeterogeneousBuilder(CPUOpBuilder):
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

    def libraries_args(self):
        return []
