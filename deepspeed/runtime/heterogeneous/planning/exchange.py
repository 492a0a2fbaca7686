# SPDX-License-Identifier: Apache-2.0
"""Whether a plan is worth re-splitting a stock loader's batches (``data/resplit.py``).

A stock loader feeds the ranks its own split (equal shares from a ``DistributedSampler``); any
other plan makes every micro-step move samples before the forward and outputs back after it.
That exchange costs about the same whatever the plan (all-gathers of the global micro-batch's
batch-first tensors, one all-reduce of the returned outputs' gradients), so the step time of a
plan ``p`` other than the fed split ``f`` is

    T(p) = max_r gas * model_r(p_r) + gas * exchange_seconds,       T(f) = max_r gas * model_r(f_r)

``exchange_seconds`` is measured: per micro-step that moved anything, the least any rank spent
moving (the rank that reaches a collective last waits for no one there, so its time is the
transfer alone). A plan that does not beat the fed split by more than its exchange is replaced by
the fed split, with one line that says why; before any exchange was measured every plan counts as
worth it, and the switch check (``rebalance.Rebalancer.judge_switch``) reverts one that made the
observed step slower.
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

from .plan import Plan


@dataclass(frozen=True)
class ExchangeVerdict:
    plan: Plan
    """The plan to adopt: the candidate, or the fed split when re-splitting does not pay."""
    note: Optional[str] = None
    """Why the fed split was kept (None when the candidate stands)."""


def fed_plan(candidate, fed_sizes, models):
    """The fed split as a plan, its times predicted by ``models`` (the candidate's gas)."""
    gas = candidate.gradient_accumulation_steps
    times = tuple(g * model.micro_step_time(size) for g, model, size in zip(gas, models, fed_sizes))
    return replace(candidate, micro_batch_sizes=tuple(fed_sizes), predicted_rank_times=times, notes=())


def step_time(plan, models):
    return max(g * model.micro_step_time(size)
               for g, model, size in zip(plan.gradient_accumulation_steps, models, plan.micro_batch_sizes))


def exchange_verdict(candidate: Plan, fed_sizes: Optional[Sequence[int]], models, exchange_seconds: Optional[float],
                     exchange_bytes: Optional[float] = None) -> ExchangeVerdict:
    """The candidate, or the fed split when the candidate's compute gain does not pay for the
    exchange it needs. ``models``: per-rank time models in seconds; ``exchange_seconds``: the
    measured exchange per micro-step (None: not measured yet); ``exchange_bytes``: the bytes a rank
    received per micro-step, for the note."""
    if (fed_sizes is None or exchange_seconds is None or models is None
            or tuple(candidate.micro_batch_sizes) == tuple(fed_sizes) or len(fed_sizes) != candidate.world_size
            or sum(fed_sizes) * candidate.gradient_accumulation_steps[0] != candidate.train_batch_size
            or candidate.per_rank_gas):
        return ExchangeVerdict(candidate)
    gas = candidate.gradient_accumulation_steps[0]
    computed, fed = step_time(candidate, models), step_time(fed_plan(candidate, fed_sizes, models), models)
    cost = gas * exchange_seconds
    if computed + cost < fed:
        return ExchangeVerdict(candidate)
    moved = f", {exchange_bytes:,.0f} B received per micro-step" if exchange_bytes else ""
    note = (f"kept the loader's split {list(fed_sizes)}: the plan {list(candidate.micro_batch_sizes)} would save "
            f"{max(fed - computed, 0.0):.4g} s of compute per step, but re-splitting the fed batches to follow it "
            f"costs {cost:.4g} s per step (measured{moved}); compute the loss inside the model and set "
            f"heterogeneous_config.return_outputs to false to exchange inputs only, or feed the plan with "
            f"engine.heterogeneous_sampler(dataset), which moves nothing")
    return ExchangeVerdict(fed_plan(candidate, fed_sizes, models), note)


def least_exchange_seconds(entries: Sequence[dict]) -> Tuple[Optional[float], Optional[float]]:
    """``(seconds, bytes)`` per micro-step from the ranks' pooled ``exchange_s`` and
    ``exchange_bytes``: the least seconds any rank measured (None when none moved anything) and
    the most bytes any rank received."""
    seconds = [entry.get("exchange_s") for entry in entries if entry.get("exchange_s") is not None]
    received = [entry.get("exchange_bytes") for entry in entries if entry.get("exchange_bytes") is not None]
    return (min(seconds) if seconds else None), (max(received) if received else None)
