# SPDX-License-Identifier: Apache-2.0
"""The pure parts of low-communication training (``low_communication.py``): the same on every rank.

- **Weights.** ``host_loss_scales`` turns the engine's loss weight into each host's sample mean;
  ``host_samples`` gives the samples per host that weigh the pseudo-gradients.
- **The outer step.** ``weighted_mean`` of the hosts' pseudo-gradients (fp32, in host order) and
  ``outer_update`` (Nesterov, in place), with ``OuterSettings`` from the config block.
- **Where the mode runs.** ``refusal`` names the setting that rules it out, or None.
"""

from dataclasses import dataclass

import torch

from .host_groups import group_layout

PSEUDO_GRADIENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def host_loss_scales(samples_per_rank, hosts):
    """Per rank: the factor that turns the engine's loss weight ``W * n_i / B`` (the world's average
    is the global-batch mean) into one whose average over the rank's host is the mean over the
    host's samples, ``P_h * B / (W * B_h)``. ``samples_per_rank``: each rank's samples per optimizer
    step (the plan's ``mbs_i * gas_i``); ``hosts``: each rank's host."""
    layout = group_layout(hosts)
    world, total = len(hosts), sum(samples_per_rank)
    host_samples = [sum(samples_per_rank[r] for r in members) for members in layout.host_members]
    return tuple(len(layout.host_members[layout.hosts[r]]) * total / (world * host_samples[layout.hosts[r]])
                 for r in range(world))


def host_samples(samples_per_rank, hosts):
    """Samples per host in one optimizer step, in host order."""
    layout = group_layout(hosts)
    return tuple(sum(samples_per_rank[r] for r in members) for members in layout.host_members)


def weighted_mean(deltas, weights):
    """``sum_h weights[h] * deltas[h]`` in fp32, added in host order (the same bits on every leader)."""
    total = torch.zeros(deltas[0].numel(), dtype=torch.float32, device=deltas[0].device)
    for delta, weight in zip(deltas, weights):
        total.add_(delta.float(), alpha=weight)
    return total


def outer_update(theta, momentum, mean, lr, mu):
    """The outer Nesterov step, in place: ``m = mu * m + mean``; ``theta -= lr * (mean + mu * m)``.
    ``momentum`` is None when ``mu`` is 0. ``mean`` is overwritten (no temporary of the model's size)."""
    if momentum is not None:
        momentum.mul_(mu).add_(mean)
        mean.add_(momentum, alpha=mu)
    theta.sub_(mean, alpha=lr)


@dataclass(frozen=True)
class OuterSettings:
    sync_every: int
    lr: float
    momentum: float
    dtype: torch.dtype

    @classmethod
    def from_config(cls, block):
        return cls(block.sync_every, block.outer_lr, block.outer_momentum,
                   PSEUDO_GRADIENT_DTYPES[block.pseudo_gradient_dtype])

    def describe(self):
        dtype = "bf16" if self.dtype is torch.bfloat16 else "fp32"
        momentum = f"Nesterov momentum {self.momentum:g}" if self.momentum else "no momentum"
        return f"every {self.sync_every} steps, outer lr {self.lr:g} with {momentum}, pseudo-gradients in {dtype}"


def refusal(settings, zero_stage, pipeline, model_parallel, has_moe, hosts, low_precision=False,
            checkpoint_writer=False):
    """Why ``mode: "low_communication"`` cannot run here (one message naming the key), or None.
    ``model_parallel``: an mpu, a device mesh or AutoTP (their groups would replace the hosts');
    ``low_precision``: fp16 or bf16."""
    key = "heterogeneous_config.communication.mode \"low_communication\""
    config = settings.config
    if pipeline:
        return f"{key} does not cover pipeline parallelism (its stages exchange activations every micro-step)"
    if model_parallel:
        return f"{key} makes each host a data-parallel replica, which model, tensor or sequence parallelism " \
               "(an mpu, a device mesh, AutoTP) already divides; use mode \"exact\""
    if has_moe:
        return f"{key} does not cover mixture-of-experts layers (their expert groups span the hosts)"
    if hosts is None or group_layout(hosts).num_hosts < 2:
        return f"{key} synchronises hosts, and every rank runs on one host; use mode \"exact\""
    if zero_stage == 3:
        return f"{key} covers ZeRO stages 0-2 (ZeRO-3 would partition each parameter over its host only); " \
               "use zero_optimization.stage 2, or mode \"exact\""
    if zero_stage == 0 and low_precision:
        return f"{key} writes the outer step into the optimizer's fp32 master weights, which ZeRO stage 0 in " \
               "fp16/bf16 does not expose; use zero_optimization.stage 1 or 2"
    if settings.memory.enabled or isinstance(settings.memory.zero_partitions, list):
        return f"{key} splits ZeRO state evenly inside each host; heterogeneous_memory (enabled, or a " \
               "zero_partitions list) plans it over every rank: turn it off"
    if settings.offload.cpu_offload or settings.offload.nvme_offload:
        return f"{key} does not cover zero_optimization.heterogeneous_offload yet"
    if config.loss_items is not None:
        return f"{key} weighs each host's loss by its samples; heterogeneous_config.loss_items weighs items " \
               "over every rank: drop loss_items"
    if config.resplit_fed_batches is True:
        return f"{key} keeps every sample on the host it was fed on; heterogeneous_config.resplit_fed_batches " \
               "true would move rows between hosts every step: feed each rank its plan (the engine's loader " \
               "or heterogeneous_sampler)"
    if config.elastic.checkpoint is not None:
        return f"{key} does not take periodic checkpoints yet (engine.save_checkpoint does: each host writes its " \
               "replica under <tag>/host<h>); drop heterogeneous_config.elastic.checkpoint"
    if checkpoint_writer:
        return f"{key} does not cover checkpoint.writer (its data-parallel writers assume one replica)"
    return None
