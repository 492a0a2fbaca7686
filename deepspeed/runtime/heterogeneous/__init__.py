# SPDX-License-Identifier: Apache-2.0
"""deepspeed-hetero: training on data-parallel ranks whose devices differ.

The fork's own modules; upstream files reach them through thin patches (see patches/series).
"""

from .config import (HeterogeneousConfig, HeterogeneousMemoryConfig, HeterogeneousOffloadConfig,
                     HeterogeneousSettings, load_heterogeneous_settings)
from .devices import (ACCELERATOR_SPECS, AcceleratorSpec, DeviceDescription, describe_local_device, find_spec,
                      measure_device_score, normalize_scores, spec_score)
from .memory_pool import HeterogeneousMemoryPool, MemoryPlacementError, ModelStateSpec

__all__ = [
    "ACCELERATOR_SPECS",
    "AcceleratorSpec",
    "DeviceDescription",
    "describe_local_device",
    "find_spec",
    "measure_device_score",
    "normalize_scores",
    "spec_score",
    "HeterogeneousConfig",
    "HeterogeneousMemoryPool",
    "MemoryPlacementError",
    "ModelStateSpec",
    "HeterogeneousMemoryConfig",
    "HeterogeneousOffloadConfig",
    "HeterogeneousSettings",
    "load_heterogeneous_settings",
]
