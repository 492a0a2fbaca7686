# SPDX-License-Identifier: Apache-2.0
"""What ``DeepSpeedEngine`` gains from the fork: the plan in force and the seed's scheduling API.

The engine inherits ``HeterogeneousEngineMixin``; every method is a thin view over the pure
planner (``planner.py``) and the config-time plan (``batch.py``).
"""

from .devices import DeviceDescription, normalize_scores
from .planner import device_score, distribute_workload, schedule_heterogeneous_tasks


class HeterogeneousEngineMixin:
    """Heterogeneous-training view of a ``DeepSpeedEngine`` (all methods read ``self._config``)."""

    @property
    def heterogeneous_plan(self):
        """The plan in force (per-rank micro-batches, gas, predicted times), or None when disabled."""
        return getattr(self._config, "heterogeneous_plan", None)

    @property
    def heterogeneous_devices(self):
        """Every data-parallel rank's DeviceDescription as gathered at start-up (None if not needed)."""
        return getattr(self._config, "heterogeneous_devices", None)

    def _get_device_score(self, device):
        """Prior speed of ``device`` (a DeviceDescription or its dict) in TFLOP/s."""
        return device_score(device)

    def _normalize_scores(self, scores):
        """Scores scaled to sum to 1."""
        return normalize_scores(scores)

    def _distribute_workload(self, normalized_scores):
        """Per-rank micro-batch sizes proportional to ``normalized_scores`` for this engine's
        global batch and gradient accumulation; exact integer sum."""
        return distribute_workload(normalized_scores, self.train_batch_size(), self._plan_gas())

    def schedule_heterogeneous_tasks(self, devices):
        """A plan for ``devices`` (DeviceDescriptions or dicts, one per data-parallel rank) from their
        prior scores, for this engine's global batch; it does not change the plan in force."""
        devices = [d if isinstance(d, DeviceDescription) else DeviceDescription.from_dict(d) for d in devices]
        return schedule_heterogeneous_tasks(devices, self.train_batch_size(), self._plan_gas())

    def _heterogeneous_train_sampler(self, dataset, data_parallel_rank):
        """The sampler ``deepspeed.initialize(training_data=...)`` uses in heterogeneous mode."""
        from .sampler import HeterogeneousDistributedSampler
        plan = self.heterogeneous_plan
        return HeterogeneousDistributedSampler(dataset, plan.micro_batch_sizes, rank=data_parallel_rank,
                                               drop_last=self.dataloader_drop_last())

    def _plan_gas(self):
        plan = self.heterogeneous_plan
        return plan.gradient_accumulation_steps[0] if plan is not None else self.gradient_accumulation_steps()
