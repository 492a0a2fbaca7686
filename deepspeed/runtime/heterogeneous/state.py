# SPDX-License-Identifier: Apache-2.0
"""The fork's state for one ``DeepSpeedConfig``: its one declared home.

``config-heterogeneous-blocks.patch`` creates it as ``DeepSpeedConfig.heterogeneous`` (always
present; ``enabled`` is False when the fork is off) and every other part of the fork reads it
from there: the engine hooks (``engine._config.heterogeneous``), the runtime, the profiler, the
autotuner's experiments. Nothing else of the fork is written onto upstream objects.

Life cycle (docs/architecture.md):

1. ``HeterogeneousState.from_config`` runs in ``DeepSpeedConfig.__init__`` *before* upstream
   validates the config: it parses the fork's blocks, gathers the devices (a collective, once)
   and writes the chosen precision into the fp16/bf16 blocks of the config dict, so upstream's
   pydantic models are built from the final values and never edited afterwards.
2. ``configure`` runs where upstream would set the batch fields: it resolves the start-up plan.
3. The engine creates the runtime at its first hook (``runtime``) and plans change through
   ``batch.apply_plan`` at step boundaries.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from deepspeed.utils import logger

from .config import HeterogeneousSettings, load_heterogeneous_settings
from .devices import DeviceDescription
from .planner import Plan
from .precision import PrecisionChoice


@dataclass
class HeterogeneousState:
    """What the fork knows and decided for this process (one per ``DeepSpeedConfig``)."""

    settings: HeterogeneousSettings
    """The fork's parsed blocks (heterogeneous_config, heterogeneous_memory, heterogeneous_offload)."""
    dp_rank: int = 0
    """This process's data-parallel rank, derived once from the mpu / mesh at config time."""
    devices: Optional[List[DeviceDescription]] = None
    """Every data-parallel rank's device, in rank order (None when no decision needs them)."""
    precision: Optional[PrecisionChoice] = None
    """The precision mixed_precision_support chose (None: the config's own blocks decide)."""
    base_gas: Optional[int] = None
    """The configured gradient accumulation; a plan may raise one rank's own (ZeRO-0/1 memory caps)."""
    plan: Optional[Plan] = None
    """The plan in force (per-rank micro-batches and gas); None when the fork is off."""
    runtime: Optional[object] = field(default=None, repr=False)
    """The engine's ``HeterogeneousRuntime``, created at its first hook."""

    @property
    def enabled(self):
        return self.settings.enabled

    @property
    def loss_weight(self):
        """w_i = W * n_i / train_batch_size for this rank; 1.0 when the fork is off.

        Every upstream reducer averages gradients over ranks; weighting rank i's loss by w_i turns
        that average into the mean over the global batch, whatever each rank's share n_i is."""
        return 1.0 if self.plan is None else self.plan.loss_weights[self.dp_rank]

    @property
    def device_names(self):
        return [d.name for d in self.devices] if self.devices else None

    @classmethod
    def from_config(cls, param_dict, world_size, mpu=None, mesh_device=None):
        """Parse the fork's blocks of ``param_dict`` (a shallow copy of the user's config, which is
        left unmodified) and, when enabled, gather the devices and apply the precision choice to
        ``param_dict`` before upstream parses it. A seed-style workload "scheduler" is moved out of
        the LR scheduler's key."""
        from .batch import data_parallel_rank, gather_local_devices
        from .precision import choose_precision_for_config

        settings = load_heterogeneous_settings(param_dict, world_size=world_size)
        for note in settings.notes:
            logger.warning(note)
        state = cls(settings)
        if not settings.enabled:
            return state
        state.dp_rank = data_parallel_rank(mpu, mesh_device)
        state.devices = gather_local_devices(settings, state.dp_rank, int(world_size))
        state.precision = choose_precision_for_config(settings.config.mixed_precision_support, state.devices,
                                                      param_dict)
        return state

    def configure(self, ds_config):
        """Upstream's batch arithmetic, replaced: set this rank's batch fields from the start-up plan.
        Returns False (and does nothing) when the fork is off."""
        from .precision import check_adaptive_scaler_config
        check_adaptive_scaler_config(ds_config)
        if not self.enabled:
            return False
        from . import comm_clock
        from .batch import configure_heterogeneous_batch
        comm_clock.enable()  # the runtime subtracts time in collectives from each rank's compute time
        configure_heterogeneous_batch(ds_config, self)
        return True
