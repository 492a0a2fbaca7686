# SPDX-License-Identifier: Apache-2.0
"""The batch a rank was actually fed, checked against the plan in force (docs/balancing.md, "Data loaders").

Each rank's loss is weighted by its *planned* share of the global batch; a loader that feeds any
other size (a user's ``DistributedSampler`` loader of equal batches, a Trainer's loader, the last
short batch of an epoch) trains inexactly and silently. The engine reads the leading dimension of
the first tensor passed to ``forward`` (a shape, no synchronisation) and stops on a mismatch.
"""

from collections.abc import Mapping

import torch


class FedBatchMismatchError(ValueError):
    """A rank was fed a micro-batch whose size differs from its planned one."""


class FeedingError(ValueError):
    """The ranks are fed in ways that cannot train together (raised on every rank at once)."""


def raised_on_every_rank(error):
    """Mark ``error`` as one that every rank raises at the same point with the same message: the
    process's last report prints it once, from rank 0 (``config/errors.py``)."""
    error.deepspeed_hetero_every_rank = True
    return error


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
    raise FedBatchMismatchError(mismatch_message([(dp_rank, fed)], plan_sizes))


def mismatch_message(wrong, plan_sizes):
    """What was fed where (``wrong``: (data-parallel rank, fed size) pairs), what the plan says, and
    how to feed it."""
    fed = "; ".join(f"data-parallel rank {rank} was fed a micro-batch of {size} samples, but the plan in force gives "
                    f"it {plan_sizes[rank]}" for rank, size in wrong)
    return (f"deepspeed-hetero: {fed} (micro-batches {list(plan_sizes)}). Each rank's loss is weighted by its "
            f"planned share of the global batch, so any other size trains inexactly. Feed the batches of the "
            f"engine's loader (deepspeed.initialize(training_data=...)), or build your DataLoader with "
            f"batch_sampler=engine.heterogeneous_sampler(dataset) (or pass your HeterogeneousBatchSampler to "
            f"engine.register_heterogeneous_sampler) so that it follows the plan and its changes (Hugging Face "
            f"Trainer: use deepspeed.runtime.heterogeneous.integrations.hf_trainer.HeterogeneousTrainer); drop a short "
            f"last batch (drop_last=True). The size is read from dim 0 of the first tensor passed to forward; "
            f"for inputs that are not batch-first set heterogeneous_config.check_fed_batch to false.")


def judge_feeding(plan, everyone, resplit_setting, check, data_parallel_is_world):
    """Whether this training forward re-splits what the ranks were fed, decided alike on every rank
    from ``everyone``: per process, ``(dp_rank, feeds_plan, fed)`` gathered at the forward, where
    ``feeds_plan`` says the engine's loader or a registered heterogeneous sampler feeds it and
    ``fed`` is the leading size of its inputs (-1: none). Raises the same error on every rank when
    the ranks are fed differently or (without re-splitting) a rank's fed size is not its planned
    one. Not for plans with per-rank gas, whose ranks run different numbers of forwards
    (``fed_size`` checks those on each rank)."""
    feeders = sorted({dp for dp, feeds, _ in everyone if feeds})
    others = sorted({dp for dp, feeds, _ in everyone if not feeds})
    if feeders and others:
        raise raised_on_every_rank(FeedingError(
            f"deepspeed-hetero: data-parallel rank(s) {feeders} are fed by the engine's loader or a registered "
            f"heterogeneous sampler and rank(s) {others} are not; the ranks would disagree on whether to re-split "
            f"their batches. Feed every rank the same way (call engine.register_heterogeneous_sampler on every rank, "
            f"or use deepspeed.initialize(training_data=...) on every rank)"))
    feeds_plan = bool(feeders)
    resplit = resplit_setting is True or (resplit_setting == "auto" and check and not feeds_plan)
    if resplit and not data_parallel_is_world:
        if resplit_setting is True:
            raise raised_on_every_rank(FeedingError(
                "heterogeneous_config.resplit_fed_batches is true, but the data-parallel ranks are not the whole world "
                "(model, pipeline or sequence parallelism): samples would have to move between replicas and reach "
                "every member of each; feed each replica its planned share (engine.heterogeneous_sampler) and set "
                "resplit_fed_batches to \"auto\" or false"))
        resplit = False  # model parallelism: the fed-batch check applies
    if not resplit and check:
        wrong = sorted({(dp, fed) for dp, _, fed in everyone if fed >= 0 and fed != plan.micro_batch_sizes[dp]})
        if wrong:
            raise raised_on_every_rank(FedBatchMismatchError(mismatch_message(wrong, plan.micro_batch_sizes)))
    return resplit


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
