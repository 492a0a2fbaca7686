# SPDX-License-Identifier: Apache-2.0
"""One experiment of the tuning space (``space.py``) and its ds_config (pure).

An experiment is one (pipeline degree and partition, ZeRO stage, gas, per-rank micro-batch sizes)
point. Its ds_config is the user's config with exactly those values replaced: every other ZeRO
setting (offload, buckets, overlap) is kept, where upstream's micro-batch experiments replaced the
whole block by ``{"stage": n}``.

``optimal_ds_config`` makes the best experiment's config one to train with; ``interpolate`` gives
the per-rank sizes between a uniform experiment and a target; ``replica_micro_batches`` reads a
pipeline experiment's sizes from its metrics.
"""

import copy
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from deepspeed.runtime.heterogeneous.planning.strategies import COMPUTE_AWARE, MANUAL, UNIFORM

from .settings import BATCH, GAS, HETERO, MBS, PIPELINE, ZERO
from .space import PARTITIONS


@dataclass(frozen=True)
class Experiment:
    stage: int
    gas: int
    micro_batch_sizes: Tuple[int, ...]
    """One size per data-parallel rank; all equal for a uniform experiment."""
    heterogeneous: bool = False
    """Run through heterogeneous_config (manual plan, or uniform on an emulated cluster)."""
    profile: bool = False
    """The profiling run: compute_aware with profiling steps; measures every rank's models."""
    pipeline_stages: Optional[int] = None
    """The pipeline degree passed to the script (None: no pipeline tuned); micro_batch_sizes then
    has one entry per replica, which compute_aware re-splits by the replicas' speeds."""
    partition: Optional[str] = None
    """heterogeneous_config.pipeline.partition (None with one stage: no cut)."""

    @property
    def uniform(self):
        return len(set(self.micro_batch_sizes)) == 1

    @property
    def train_batch_size(self):
        return sum(self.micro_batch_sizes) * self.gas

    @property
    def name(self):
        if self.profile:
            return f"profile_z{self.stage}_gas{self.gas}_tbs{self.train_batch_size}"
        sizes = str(self.micro_batch_sizes[0]) if self.uniform else "-".join(map(str, self.micro_batch_sizes))
        return f"{self.pipeline_prefix}z{self.stage}_gas{self.gas}_tmbspg{sizes}"

    @property
    def pipeline_prefix(self):
        """``pp2bal_``: degree 2, balanced partition; ``pp1_``: one stage; '' without a pipeline."""
        if self.pipeline_stages is None:
            return ""
        return f"pp{self.pipeline_stages}{PARTITIONS.get(self.partition, '')}_"

    def ds_config(self, user_config, metric_path, settings, profile_steps=3):
        """The user's config with this experiment's values; tuning lists and 'auto' removed."""
        config = copy.deepcopy(user_config)
        block = config.get("autotuning") or {}
        for key in (MBS, GAS, ZERO, PIPELINE):
            block.pop(key, None)
        block.update(enabled=True, metric=settings.metric, metric_path=metric_path,
                     start_profile_step=settings.start_profile_step, end_profile_step=settings.end_profile_step)
        block.pop("model_info", None)  # upstream's model-info run stops the script after one step
        config["autotuning"] = block
        zero = dict(config.get(ZERO) or {})
        zero["stage"] = self.stage
        config[ZERO] = zero
        config[BATCH] = self.train_batch_size
        config[GAS] = self.gas
        hetero = dict(config.get(HETERO) or {})
        if self.pipeline_stages is not None:
            config.pop(MBS, None)
            # The replicas' plan follows their pipelines' speeds as the engine starts (no profiling
            # steps with a pipeline); with one replica it is the whole batch.
            hetero.update(enabled=True, load_balancing_strategy=COMPUTE_AWARE)
            hetero.pop("micro_batch_sizes", None)
            if self.partition is not None:
                hetero["pipeline"] = {**(hetero.get("pipeline") or {}), "partition": self.partition}
        elif self.profile:
            config.pop(MBS, None)
            hetero.update(enabled=True, load_balancing_strategy=COMPUTE_AWARE, profile_steps=profile_steps)
            hetero.pop("micro_batch_sizes", None)
        elif self.heterogeneous:
            config.pop(MBS, None)
            hetero.update(enabled=True)
            if self.uniform:
                hetero.update(load_balancing_strategy=UNIFORM)
                hetero.pop("micro_batch_sizes", None)
            else:
                hetero.update(load_balancing_strategy=MANUAL, micro_batch_sizes=list(self.micro_batch_sizes))
        else:
            config[MBS] = self.micro_batch_sizes[0]
        if self.profile or self.heterogeneous or self.pipeline_stages is not None:
            scheduler = dict(hetero.get("scheduler") or {})
            scheduler.pop("type", None)
            scheduler["dynamic_rebalancing"] = False  # an experiment measures one fixed plan
            hetero["scheduler"] = scheduler
            config[HETERO] = hetero
        return config


def replica_micro_batches(metrics, replicas):
    """The per-replica micro-batches a pipeline experiment ran, from its metrics: global rank g is
    stage g // replicas, replica g % replicas, so stage 0's ranks are the first ``replicas``."""
    ranks = sorted(metrics.get("ranks") or [], key=lambda entry: entry["rank"])
    if len(ranks) < replicas:
        return None
    return [int(entry["micro_batch_size"]) for entry in ranks[:replicas]]


def interpolate(uniform, target, fraction):
    """Integer sizes on the line from ``uniform`` to ``target`` at ``fraction`` (may exceed 1),
    each >= 1, summing to sum(uniform); None when the point leaves the valid range."""
    total = sum(uniform)
    raw = [u + fraction * (t - u) for u, t in zip(uniform, target)]
    if any(value < 1 for value in raw):
        return None
    sizes = [max(1, int(math.floor(value))) for value in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order[:total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes) if sum(sizes) == total else None


def optimal_ds_config(experiment_config, user_config):
    """The best experiment's config made for training: autotuning off, and the user's own
    heterogeneous scheduler settings back (experiments measure one fixed plan).

    With the user's dynamic rebalancing on, the plan cannot be a fixed (manual) one: the config
    keeps the tuned stage, gas and global batch and lets compute_aware find and follow the plan.
    """
    config = copy.deepcopy(experiment_config)
    block = config.get("autotuning") or {}
    block["enabled"] = False  # trains; does not stop after the measuring window
    block.pop("metric_path", None)
    config["autotuning"] = block
    hetero = config.get(HETERO)
    if hetero is None:
        return config
    scheduler = copy.deepcopy((user_config.get(HETERO) or {}).get("scheduler"))
    if scheduler is None:
        hetero.pop("scheduler", None)
        return config
    scheduler.pop("type", None)  # the strategy is load_balancing_strategy's
    hetero["scheduler"] = scheduler
    if scheduler.get("dynamic_rebalancing"):
        hetero["load_balancing_strategy"] = COMPUTE_AWARE
        hetero.pop("micro_batch_sizes", None)
    return config
