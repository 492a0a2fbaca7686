# SPDX-License-Identifier: Apache-2.0
"""The batch a rank was actually fed, checked against the plan in force (docs/architecture.md §4.3).

Each rank's loss is weighted by its *planned* share of the global batch; a loader that feeds any
other size (a user's ``DistributedSampler`` loader of equal batches, a Trainer's loader, the last
short batch of an epoch) trains inexactly and silently. The engine reads the leading dimension of
the first tensor passed to ``forward`` (a shape, no synchronisation) and stops on a mismatch.
"""

from collections.abc import Mapping

import torch


class FedBatchMismatchError(ValueError):
    """A rank was fed a micro-batch whose size differs from its planned one."""


def leading_batch_size(inputs, kwargs):
    """Dim 0 of the first tensor in ``inputs`` (positional arguments, depth first), else in
    ``kwargs`` (in the order given, e.g. ``input_ids=``); None when no tensor has a dimension."""
    for value in (inputs, kwargs):
        size = _first_leading_dim(value)
        if size is not None:
            return size
    return None


def _first_leading_dim(value):
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    if isinstance(value, Mapping):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return None
    for item in value:
        size = _first_leading_dim(item)
        if size is not None:
            return size
    return None


def check_fed_batch(fed, planned, dp_rank, plan_sizes):
    """Raise ``FedBatchMismatchError`` when ``fed`` (None: unknown, not checked) differs from
    ``planned``; the message says what the plan is and how to feed it."""
    if fed is None or fed == planned:
        return
    raise FedBatchMismatchError(
        f"deepspeed-hetero: data-parallel rank {dp_rank} was fed a micro-batch of {fed} samples, but the plan "
        f"in force gives it {planned} (micro-batches {list(plan_sizes)}). Each rank's loss is weighted by its "
        f"planned share of the global batch, so any other size trains inexactly. Feed the batches of the "
        f"engine's loader (deepspeed.initialize(training_data=...)), or build your DataLoader with "
        f"batch_sampler=engine.heterogeneous_sampler(dataset) (or pass your HeterogeneousBatchSampler to "
        f"engine.register_heterogeneous_sampler) so that it follows the plan and its changes (Hugging Face "
        f"Trainer: use deepspeed.runtime.heterogeneous.integrations.hf_trainer.HeterogeneousTrainer); drop a short "
        f"last batch (drop_last=True). The size is read from dim 0 of the first tensor passed to forward; "
        f"for inputs that are not batch-first set heterogeneous_config.check_fed_batch to false.")


def fed_size(plan, dp_rank, inputs, kwargs, engine_loader, check=True):
    """The size of the micro-batch a training forward was given, checked against ``plan`` (None
    when it cannot be read or ``check`` is off). Also refuses a plan with per-rank gas unless the
    engine's own loader feeds the ranks (``engine_loader``)."""
    if plan.per_rank_gas and not engine_loader:
        raise FedBatchMismatchError(
            f"deepspeed-hetero: the plan in force gives the ranks different gradient_accumulation_steps "
            f"{list(plan.gradient_accumulation_steps)}, which only the engine's own loader "
            f"(deepspeed.initialize(training_data=...)) feeds correctly: a loop that counts micro-steps itself "
            f"would pair the ranks' gradient reductions wrongly. Use the engine's loader, or give the ranks "
            f"equal gas (a manual plan without per-rank gas, or more memory)")
    if not check:
        return None
    fed = leading_batch_size(inputs, kwargs or {})
    check_fed_batch(fed, plan.micro_batch_sizes[dp_rank], dp_rank, plan.micro_batch_sizes)
    return fed
