# SPDX-License-Identifier: Apache-2.0
"""Builder of the fork's native op for the CPU accelerator.

Prebuilt by ``pip install . --config-settings="--build-option=--heterogeneous-support"`` (or
DS_BUILD_HETEROGENEOUS=1); otherwise JIT-built with ninja on first use.
"""

from ..heterogeneous import HeterogeneousOpSpec
from .builder import CPUOpBuilder


class HeterogeneousBuilder(HeterogeneousOpSpec, CPUOpBuilder):

    def libraries_args(self):
        return []
