# SPDX-License-Identifier: Apache-2.0
"""deepspeed-hetero: training on data-parallel ranks whose devices differ.

The fork's own code, by concern (lowest layer first; a subpackage imports only those before it):

- ``config``: the ``heterogeneous_config`` blocks and their loading, the strategy registry;
- ``measure``: timers, the comm clock, device description and score, the native op;
- ``cluster``: the collective edge (``Agreement``), topology, rank derivation, the device gather;
- ``emulation``: emulated speeds and memory, the cgroups behind them;
- ``memory``: model-state bytes, peak prediction and measurement, the memory pool and placement;
- ``planning``: plans, strategies, time models, profiling and rebalancing decisions, precision choice;
- ``data``: samplers, the engine's loader, the fed-batch check, the re-split and its account;
- ``comm``: hierarchical reduction, host groups, link-aware buckets;
- ``pipeline``: heterogeneous pipeline stages and their checkpoints;
- ``integrations``: the Hugging Face Trainer, the weighting of losses normalised over items;
- ``cli``: the env report, the launcher's checks, process exit.

At the top: ``state`` (what a ``DeepSpeedConfig`` carries), ``startup`` (the start-up flow),
``engine`` (the engine's hooks), ``runtime`` (the runtime controller), ``checkpoint``,
``autotuning_window`` (the engine side of an autotuning experiment). Upstream
files reach these through thin patches (see patches/series). This module loads nothing until a
public name is used, so ``import deepspeed.comm`` (which imports the comm clock) stays light.
"""

import importlib

_PUBLIC = {
    "HeterogeneousConfig": "config.settings",
    "HeterogeneousMemoryConfig": "config.settings",
    "HeterogeneousOffloadConfig": "config.settings",
    "HeterogeneousSettings": "config.settings",
    "load_heterogeneous_settings": "config.settings",
    "ACCELERATOR_SPECS": "measure.devices",
    "AcceleratorSpec": "measure.devices",
    "DeviceDescription": "measure.devices",
    "describe_local_device": "measure.devices",
    "find_spec": "measure.devices",
    "measure_device_score": "measure.devices",
    "normalize_scores": "measure.devices",
    "spec_score": "measure.devices",
    "HeterogeneousMemoryPool": "memory.pool",
    "MemoryPlacementError": "memory.rank_placement",
    "ModelStateSpec": "memory.pool",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
