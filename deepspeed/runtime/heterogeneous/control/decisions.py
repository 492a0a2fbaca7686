# SPDX-License-Identifier: Apache-2.0
"""What the runtime controller decides from the ranks' pooled measurements.

``PlanDecisions`` holds what the decisions are made from and returns each as a typed
``PlanDecision`` (``cluster/agreement.py``), which the controller broadcasts from rank 0:

- after each profiling step (``after_profiling``): the next plan, and after the last one whether
  the switch waits for a check;
- at a check (``at_check``): first the judgement of the last switch (reverted if it made the step
  slower), then, with dynamic rebalancing or on demand (``reschedule_workload``), whether to move
  work.

Every rank keeps the pooled profiling history, the fitted models and the plan changes (checkpoints,
the profiler and the autotuner read them); only rank 0's rebalancer decides. The policies are pure
(``planning/profiling.py``, ``planning/rebalance.py``); this module joins them with what re-splitting
a stock loader's batches costs (``data/exchange_account.py``). No collective: the controller
gathers and broadcasts. Any failure while deciding becomes the decision's failure, which every
rank raises together.
"""

import copy
import statistics
from dataclasses import asdict, replace

from deepspeed.utils import logger

from ..cluster.agreement import PlanDecision
from ..emulation.limits import profiled_speeds_note
from ..planning.planner import TimeModel, plan_micro_batches
from ..planning.profiling import (measured_rates, measured_time_models, memory_limits, plan_after_profiling_step,
                                 reference_walls)
from ..planning.rebalance import RebalanceEvent, RebalancePolicy, Rebalancer, balanced_models, window_models

__all__ = ["PlanDecisions", "nothing_measured", "plan_block"]


class PlanDecisions:
    """The decisions of one engine's controller (every rank builds one; rank 0's decides).

    ``exchange`` is the controller's ``ExchangeAccount``; ``dynamic``: whether dynamic rebalancing
    checks run. Each decision is given how the ranks run now (``steps``, whether per-rank gas is
    allowed, whether the last forward re-split the ranks' batches)."""

    def __init__(self, state, capacities, exchange, dynamic):
        self.state = state
        self.settings = state.settings.config
        self.capacities = capacities
        self.exchange = exchange
        self.dynamic = dynamic
        self.history = []  # per profiling step: every data-parallel rank's pooled measurements
        self.base_models = None  # the profiled fits alone: what an on-demand re-plan scales
        self.events = []  # RebalanceEvent per plan change after profiling (every rank keeps them)
        scheduler = self.settings.scheduler
        # Without dynamic rebalancing the rebalancer serves reschedule_workload() alone, which needs no policy.
        policy = RebalancePolicy(scheduler.imbalance_threshold, scheduler.cooldown_checks) if dynamic else None
        self.rebalancer = Rebalancer(policy)
        self._running = (0, False, False)  # (steps, per-rank gas allowed, re-splits) of the decision being made

    @property
    def plan(self):
        return self.state.plan

    def measured_time_models(self):
        """Per-rank time models fitted to the profiling steps (see ``profiling.measured_time_models``)."""
        models, self.base_models = measured_time_models(self.history, self.state.base_gas)
        return models

    def memory_limits(self):
        """Per-rank micro-batch limits from the profiling steps' activations, or None without capacities."""
        return memory_limits(self.history, self.capacities, self.state.device_names,
                             self.state.settings.memory.hbm_utilization_threshold)

    # -- profiling ----------------------------------------------------------------------------

    def after_profiling(self, last, steps, per_rank_gas, resplits):
        """Rank 0's decision after a profiling step (``history`` holds it): the plan for the next
        step; after the ``last`` one, also the note to log and whether the switch awaits a check."""
        self._running = (steps, per_rank_gas, resplits)
        try:
            rebalancer = self.rebalancer
            if rebalancer.startup_plan is None:
                # The first profiling step ran it, or its cap within memory before activations were measured.
                rebalancer.startup_plan = self.state.reference_plan or self.plan
            startup = rebalancer.startup_plan
            steps_left = max(self.settings.profile_steps - len(self.history), 0)
            decision = plan_after_profiling_step(self.history, self.plan, self.state.base_gas, self.memory_limits(),
                                                 per_rank_gas, steps_left, startup,
                                                 strategy=self.settings.load_balancing_strategy)
            plan = decision.plan
            if not last:
                return PlanDecision(plan=plan.to_dict())
            _, self.base_models = measured_time_models(self.history, self.state.base_gas)
            self.exchange.update_estimate(self.history[-1])
            kept_fed = self._worth_resplitting(plan, decision.models)
            if kept_fed is not plan:
                plan, decision = kept_fed, replace(decision, plan=kept_fed,
                                                   note="; ".join(filter(None, [decision.note, self.exchange.note])))
            # What dynamic rebalancing scales. A start-up plan kept within the noise has no models:
            # with dynamic rebalancing the first check fits per-sample models from its own interval
            # (so a plan kept for noise alone is corrected once the checks measure a difference);
            # without, it is the reference of drift only.
            if decision.models is None and self.dynamic:
                rebalancer.plan_chosen(None)
            else:
                rebalancer.plan_chosen(decision.models or balanced_models(plan))
            emulated = profiled_speeds_note(self.settings.emulation, measured_rates(self.history), steps)
            note = "; ".join(filter(None, [decision.note, emulated, self._starved_note(plan)])) or None
            verify = False
            if _sizes(plan) != _sizes(self.plan):
                unchecked = rebalancer.switched(self.plan, plan, reference_walls(self.history, startup), None,
                                                "switch after profiling")
                verify = unchecked is None
                note = "; ".join(filter(None, [note, unchecked]))
            return PlanDecision(plan=plan.to_dict(), note=note, verify=verify)
        except Exception as exc:  # noqa: BLE001 -- every failure must reach every rank
            return PlanDecision.failed(self._with_share_advice(exc))

    def _measured_activations(self):
        """Per rank, the activation bytes of one sample the profiling steps measured (0 where none)."""
        from ..memory.model_state import fit_activation_model
        per_sample = []
        for rank in range(len(self.history[-1])):
            measured = [(m, b) for step in self.history for m, _, b in step[rank]["samples"] if b is not None]
            per_sample.append(fit_activation_model(measured).bytes_for(1) if measured else 0.0)
        return per_sample

    def _place_copy(self, pool):
        """``place(activation_bytes)`` with ``"auto"`` shares on a copy of the engine's pool, with its offload
        settings: placing again must leave the engine's pool and its placement as they are."""
        from ..memory.placement import engine_placement
        offload = self.state.settings.offload
        spare = copy.copy(pool)
        return lambda activations: engine_placement(spare, pool.model_state, "auto", offload.cpu_offload,
                                                    offload.nvme_offload, baseline_bytes=pool._baselines,
                                                    activation_bytes=activations)[0]

    def _starved_note(self, plan):
        """Under ``"auto"`` shares on ranks whose memory binds, the shares in force weighed against the other
        choice on the profiling steps' measurements (``activation_room``): without an activation estimate,
        the advice when memory holds a rank below its speed's part of the micro-step
        (``starved_ranks_advice``), given only where the forecast step is shorter; with one, the advice to
        remove it when the shares chosen without it forecast a shorter step (``reserved_room_advice``)."""
        from ..memory.activation_room import reserved_room_advice, starved_ranks_advice
        memory = self.state.settings.memory
        pool = getattr(self.state, "memory_pool", None)
        if pool is None or pool.placement is None or memory.zero_partitions != "auto" or \
                not self.history or pool.placement.zero_stage < 1:
            return None
        try:
            place = self._place_copy(pool)
            weigh = self._share_weigher(pool, plan)
            if memory.activation_bytes:
                return None if weigh is None else reserved_room_advice(*weigh(place(None)))
            speeds = [1.0 / rate for rate in measured_rates(self.history)]
            return starved_ranks_advice(pool, list(plan.micro_batch_sizes), self._measured_activations(), speeds,
                                        place, weigh)
        except Exception:  # noqa: BLE001 -- the advice is a courtesy; the plan stands without it
            return None

    def _share_weigher(self, pool, plan):
        """``weigh(placement)``: ``(current, other)`` ``ShareOption``s of the shares in force at ``plan`` and of
        ``placement``'s shares at the micro-batches the planner gives within the room they leave
        (``activation_room.weigh_shares``); None where the step cannot be forecast (no memory limits, no
        activations measured, gas differing between ranks)."""
        from ..memory.activation_room import ShareOption, forecast_step_seconds, limits_after_move, weigh_shares
        from ..planning.profiling import fit_steps
        per_rank_gas = set(plan.gradient_accumulation_steps)
        limits = self.memory_limits()
        per_sample = max(self._measured_activations() or [0.0])
        if len(per_rank_gas) != 1 or limits is None or per_sample <= 0 or self.base_models is None:
            return None
        (gas, ) = per_rank_gas
        world = len(plan.micro_batch_sizes)
        steps = fit_steps(self.history)
        overheads = [sum(step[r]["step_overhead"] for step in steps) / len(steps) for r in range(world)]
        collective_s = min(sum(step[r].get("collective_s") or 0.0 for step in steps) / len(steps)
                           for r in range(world))
        shares_now = list(pool.placement.partition_shares or [1.0 / world] * world)
        held_now = _state_held(pool.placement)
        fits = self.base_models
        models = [TimeModel(fit.a + overhead / gas, fit.b) for fit, overhead in zip(fits, overheads)]

        def plan_for(moved_limits):
            return plan_micro_batches(models, train_batch_size=plan.train_batch_size, gradient_accumulation_steps=gas,
                                      strategy=self.settings.load_balancing_strategy,
                                      max_micro_batch=moved_limits).micro_batch_sizes

        current = ShareOption(tuple(shares_now), tuple(plan.micro_batch_sizes),
                              forecast_step_seconds(fits, plan.micro_batch_sizes, gas, overheads, collective_s,
                                                    shares_now, shares_now))

        def weigh(placement):
            shares = list(placement.partition_shares or [1.0 / world] * world)
            moved = limits_after_move(limits, per_sample, held_now, _state_held(placement))
            (other, ) = weigh_shares([(shares, moved)], fits, gas, overheads, collective_s, shares_now, plan_for)
            return current, other

        return weigh

    def _with_share_advice(self, exc):
        """A rank that cannot hold one sample under ``"auto"`` shares, chosen before any activation was
        measured: the error names the shares that leave every rank room for the largest part of its
        speed's samples with the activations measured now (``activation_room``; the shares are fixed once
        the optimizer holds its state), and the estimate from which ``"auto"`` chooses them."""
        from ..memory.activation_room import activation_room, speed_targets
        from ..memory.model_state import RankCannotFitError
        from ..memory.partitions import describe_shares
        pool = getattr(self.state, "memory_pool", None)
        if not isinstance(exc, RankCannotFitError) or pool is None or pool.placement is None or \
                self.state.settings.memory.zero_partitions != "auto" or not self.history:
            return exc
        try:
            speeds = [1.0 / rate for rate in measured_rates(self.history)]
            samples = sum(self.plan.micro_batch_sizes)
            per_sample = max(self._measured_activations())
            place = self._place_copy(pool)
            activations, fraction = activation_room(place, speeds, per_sample, samples)
            placement = None if activations is None else place(activations)
        except Exception:  # noqa: BLE001 -- the advice is a courtesy; the error stands without it
            return exc
        if placement is None or placement.partition_shares is None or placement.problems:
            return exc
        room = [int(fraction * target) for target in speed_targets(speeds, samples)]
        if min(room) < 1:
            return exc
        return RankCannotFitError(
            f"{exc}; or, since heterogeneous_memory.zero_partitions \"auto\" chose the shares "
            f"{describe_shares(pool.placement.partition_shares or [1 / len(speeds)] * len(speeds))} before any "
            f"activation was measured, set heterogeneous_memory.activation_bytes_per_sample to {int(per_sample)} "
            f"(measured now: {per_sample / 2**20:.3g} MiB per sample), from which \"auto\" chooses shares "
            f"{describe_shares(placement.partition_shares)} that leave the ranks room for {room} samples per "
            f"micro-step (or set zero_partitions to {list(placement.partition_shares)})")

    # -- checks -------------------------------------------------------------------------------

    def at_check(self, everyone, forced_models, on_demand, steps, per_rank_gas, resplits):
        """Rank 0's decision at a check from ``everyone``'s pooled interval: first judge the last
        switch on the steps since (revert it if it made the step slower), then, with dynamic
        rebalancing or ``on_demand``, the check itself (``forced_models``: the caller's)."""
        self._running = (steps, per_rank_gas, resplits)
        try:
            walls = [max(step) for step in zip(*(entry["walls"] for entry in everyone))]
            wall = statistics.median(walls) if walls else max(entry["wall"] for entry in everyone)
            self.exchange.update_estimate(everyone)
            judged = self._observe_last_event(walls, steps)
            if judged is not None and judged.revert:
                # A comparison's first half leaves the switch pending: its second half is judged
                # one interval later, with or without dynamic rebalancing.
                return PlanDecision(plan=judged.plan.to_dict(), reason=judged.reason, gain=judged.predicted_gain,
                                    wall=wall, revert=True, verify=self.rebalancer.pending is not None)
            note = None if judged is None else judged.reason
            if on_demand:
                models = forced_models or window_models([e["samples"] for e in everyone], self.base_models,
                                                        [e["step_overhead"] for e in everyone], self.state.base_gas)
                decision = self.rebalancer.check_on_demand(self.plan, models, self._best_plan_for,
                                                           self.settings.scheduler.imbalance_threshold)
            elif self.dynamic:
                decision = self.rebalancer.check(self.plan, [e["step_times"] for e in everyone], self._best_plan_for)
            else:  # the check of a switch without dynamic rebalancing (again while too few steps)
                return PlanDecision(reason=note or "nothing to check", note=note,
                                    verify=self.rebalancer.pending is not None)
            if not decision.rebalance:
                return PlanDecision(reason=decision.reason, gain=decision.predicted_gain,
                                    note="; ".join(filter(None, [note, self.exchange.note])) or None,
                                    verify=self.rebalancer.pending is not None)
            unchecked = self.rebalancer.switched(self.plan, decision.plan, walls, self.rebalancer.previous_models,
                                                 f"rebalance at step {steps}")
            return PlanDecision(plan=decision.plan.to_dict(), reason=decision.reason, gain=decision.predicted_gain,
                                wall=wall, verify=unchecked is None,
                                note="; ".join(filter(None, [note, self.exchange.note, unchecked])))
        except Exception as exc:  # noqa: BLE001 -- every failure must reach every rank
            return PlanDecision.failed(exc)

    def switched(self, steps, old, new, decision, kind):
        """Every rank: record the plan change a check decided (``RebalanceEvent``)."""
        self.events.append(RebalanceEvent(steps, tuple(old.micro_batch_sizes), tuple(new.micro_batch_sizes),
                                          decision.gain, decision.wall, kind=kind))

    def _best_plan_for(self, models):
        _, per_rank_gas, _ = self._running
        best = plan_micro_batches(models, train_batch_size=self.plan.train_batch_size,
                                  gradient_accumulation_steps=self.state.base_gas,
                                  strategy=self.settings.load_balancing_strategy,
                                  max_micro_batch=self.memory_limits(), allow_per_rank_gas=per_rank_gas)
        return self._worth_resplitting(best, models)

    def _worth_resplitting(self, plan, models):
        """``plan``, or the loader's split when re-splitting to ``plan`` costs more than it saves
        (``exchange.note`` says why)."""
        self.exchange.note = None
        if not self._running[2] or models is None:
            return plan
        return self.exchange.worth_resplitting(plan, models)

    def _observe_last_event(self, walls, steps):
        """Judge the last switch on ``walls`` (per-step wall seconds, the slowest rank's, at the plan
        in force since): None when nothing is pending, else the Decision (a revert, or kept); the
        event's observed step time and gain are filled in and logged."""
        judged = self.rebalancer.judge_switch(self.plan, walls)
        event = self.events[-1] if self.events else None
        if walls and event is not None and event.step_time_after is None and event.step < steps:
            event.step_time_after = sorted(walls)[len(walls) // 2]
            logger.info(f"deepspeed-hetero {event.kind} at step {event.step}: predicted gain "
                        f"{event.predicted_gain:.1%}, observed {event.observed_gain:.1%} (step time "
                        f"{event.step_time_before:.4g} s -> {event.step_time_after:.4g} s)")
        return judged

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self):
        """The profiling steps' measurements, the fitted models, the rebalancer (the models and
        baseline of the plan in force, the switch awaiting its check, the reverted plans, the
        start-up plan) and the plan changes, as plain values."""
        return {
            "history": copy.deepcopy(self.history),
            "base_models": None if self.base_models is None else [[m.a, m.b] for m in self.base_models],
            "rebalancer": self.rebalancer.state_dict(),
            "events": [asdict(event) for event in self.events],
        }

    def load_state_dict(self, state):
        self.history = copy.deepcopy(state["history"])
        models = state["base_models"]
        self.base_models = None if models is None else [TimeModel(a, b) for a, b in models]
        self.rebalancer.load_state_dict(state["rebalancer"])
        self.events = [RebalanceEvent(**{**event, "old_sizes": tuple(event["old_sizes"]),
                                         "new_sizes": tuple(event["new_sizes"])}) for event in state["events"]]


def plan_block(title, plan, names, change=None):
    """A plan as the controller prints it: a title, an optional line saying what changed, and the
    plan's table (``names``: the devices', in rank order, or None).

    Printed, not logged: DeepSpeed's logger shows WARNING and above by default, and a plan is not a
    warning, yet it is the first thing a user of the fork wants to see (as the flops profiler
    prints its report)."""
    lines = [f"[deepspeed-hetero] {title} (strategy {plan.strategy}):"]
    if change:
        lines.append(f"  {change}")
    lines.append(plan.format_table(names))
    return "\n".join(lines)


def nothing_measured(phase, profiled, profile_steps, steps):
    """Why ``reschedule_workload()`` without metrics has nothing to re-plan from, in one line
    (``phase``: the controller's, by value; ``profiled``: profiling steps taken)."""
    alternative = ("pass utilization_metrics (per-rank busy seconds per step, e.g. "
                   "HeterogeneousProfiler(engine).get_metrics()) to re-plan from them now")
    if phase == "profiling":
        return (f"reschedule_workload(): the profiling steps are still measuring ({profiled} of "
                f"{profile_steps} taken) and re-plan at their end; {alternative}")
    if phase == "static":
        return ("reschedule_workload(): nothing is measured once the plan has settled (profiling is over and "
                "heterogeneous_config.scheduler.dynamic_rebalancing is off: timing every step would cost a "
                f"device synchronisation per step); {alternative}, or turn on dynamic_rebalancing, whose "
                "checks measure every step")
    return (f"reschedule_workload(): no step was measured since the last check (step {steps}); train "
            f"some steps first, or {alternative}")


def _sizes(plan):
    return plan.micro_batch_sizes, plan.gradient_accumulation_steps


def _state_held(placement):
    """Per rank, the bytes a placement keeps on the device besides the activations reserved in it."""
    return [rank.device_bytes - (rank.activation_bytes or 0.0) for rank in placement.ranks]
