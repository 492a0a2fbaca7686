# SPDX-License-Identifier: Apache-2.0
"""deepspeed-hetero: training on data-parallel ranks whose devices differ.

The fork's own modules; upstream files reach them through thin patches (see patches/series).
"""

from .config import (HeterogeneousConfig, HeterogeneousMemoryConfig, HeterogeneousOffloadConfig,
                     HeterogeneousSettings, load_heterogeneous_settings)

__all__ = [
    "HeterogeneousConfig",
    "HeterogeneousMemoryConfig",
    "HeterogeneousOffloadConfig",
    "HeterogeneousSettings",
    "load_heterogeneous_settings",
]
