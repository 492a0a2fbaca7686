# SPDX-License-Identifier: Apache-2.0
"""When to rebalance during training (docs/balancing.md, "Dynamic rebalancing"): pure decision logic, no processes.

Every ``check_interval`` steps the runtime fits each rank's time model to the steps since the
last check and asks ``RebalancePolicy.check`` whether the best plan for those models beats the
plan in force. A new plan is adopted only when

- its predicted gain, ``1 - T(best) / T(current)`` under the same models, exceeds
  ``imbalance_threshold``,
- on ``CONSECUTIVE`` checks in a row (one noisy interval never moves work), and
- at least ``cooldown_checks`` checks have passed since the last rebalance (the new plan is
  measured for a whole interval before it can be judged).

Noise alone gives gains of a few per cent around zero: below a 10% threshold, twice in a row,
it does not rebalance, and the cool-down rules out moving work back and forth. On a loaded
machine the noise can exceed any fixed threshold, so each check also estimates it from the
interval's own measurements (``interval_noise``): a predicted gain within the noise is no gain.

``Rebalancer`` holds rank 0's state across checks (the models that chose the plan in force and
the baseline interval they are scaled against) and turns an interval's measurements into a
``Decision``; the runtime only pools the measurements and broadcasts the decision.

Every switch (after profiling, a rebalance, ``reschedule_workload``) is then checked against
what it was meant to improve: the observed step time (wall, the slowest rank) of the steps at
the new plan against the steps before it (``slowdown_beyond_noise``). A switch that made the
step slower beyond the noise is reverted, and the plan it brought is not adopted again for
``RETRY_AFTER_CHECKS`` checks: a prediction is only a prediction, and a user must be able to
trust that a plan never stays worse than the one it replaced. A step slower within the noise
sends the run back to the plan before for one more interval, and the plan whose steps are the
faster, all counted, stays.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from .planner import Plan, TimeModel, fit_time_model
from .statistics import MIN_STEPS_TO_JUDGE, interval_noise, interval_statistics, median, slowdown_beyond_noise

CONSECUTIVE = 2
"""Checks in a row whose predicted gain must exceed the threshold."""

RETRY_AFTER_CHECKS = 10
"""Checks during which a reverted plan is not adopted again."""


@dataclass(frozen=True)
class Decision:
    rebalance: bool
    predicted_gain: float
    """1 - T(best) / T(current) under the latest models (negative: the current plan is better)."""
    reason: str
    plan: Optional[Plan] = None
    """The plan to adopt when ``rebalance`` (``Rebalancer.check`` only)."""
    revert: bool = False
    """``plan`` is the plan before a switch that made the step slower (``Rebalancer.judge_switch``)."""


def predicted_gain(current_time, best_time):
    if current_time <= 0:
        return 0.0
    return 1.0 - best_time / current_time


class RebalancePolicy:
    """Hysteresis around the predicted gain of re-planning; one instance per training run."""

    def __init__(self, imbalance_threshold, cooldown_checks=1, consecutive=CONSECUTIVE):
        if not 0.0 < imbalance_threshold < 1.0:
            raise ValueError(f"imbalance_threshold {imbalance_threshold} must be in (0, 1)")
        self.threshold = imbalance_threshold
        self.cooldown_checks = int(cooldown_checks)
        self.consecutive = int(consecutive)
        self.streak = 0
        self.cooldown = 0
        self.events = 0

    def check(self, current_time, best_time, noise=0.0):
        """Decide from the predicted step times of the plan in force and of the best plan.

        ``noise``: the relative error of those predictions (``interval_noise``); a predicted gain
        not above it is taken as 0, since noise alone could have produced it."""
        gain = predicted_gain(current_time, best_time)
        if 0.0 < gain <= noise:
            self.streak = 0
            if self.cooldown > 0:
                self.cooldown -= 1
            return Decision(False, 0.0, f"predicted gain {gain:.1%} is within the measured noise {noise:.1%} "
                            f"(a longer scheduler.check_interval measures more steps per check)")
        if self.cooldown > 0:
            self.cooldown -= 1
            self.streak = 0
            return Decision(False, gain, f"cool-down after a rebalance ({self.cooldown} more check(s), "
                            f"scheduler.cooldown_checks)")
        if gain <= self.threshold:
            self.streak = 0
            return Decision(False, gain, f"predicted gain {gain:.1%} <= threshold {self.threshold:.0%} "
                            f"(scheduler.imbalance_threshold)")
        self.streak += 1
        if self.streak < self.consecutive:
            return Decision(False, gain, f"predicted gain {gain:.1%} > threshold on {self.streak} of "
                            f"{self.consecutive} consecutive checks")
        self.streak = 0
        self.cooldown = self.cooldown_checks
        self.events += 1
        return Decision(True, gain, f"predicted gain {gain:.1%} > threshold {self.threshold:.0%} "
                        f"(scheduler.imbalance_threshold) on {self.consecutive} consecutive checks")


@dataclass
class RebalanceEvent:
    """One rebalance, for the log and the profiler's timeline."""

    step: int
    old_sizes: tuple
    new_sizes: tuple
    predicted_gain: float
    step_time_before: float
    step_time_after: Optional[float] = None
    kind: str = "rebalance"
    """"rebalance" (a check or ``reschedule_workload``) or "revert" (back to the plan before a switch
    that made the step slower)."""

    @property
    def observed_gain(self):
        if self.step_time_after is None or self.step_time_before <= 0:
            return None
        return 1.0 - self.step_time_after / self.step_time_before


def balanced_models(plan):
    """Models under which ``plan`` is exactly balanced (every rank's step predicted at 1.0): the
    reference for drift when the plan in force was kept or restored on observation rather than
    chosen by models (profiling kept the start-up plan within the noise; a switch was reverted).
    Nothing changed, nothing to gain; a rank that slows down later still shows as drift."""
    return [TimeModel(0.0, 1.0 / n) for n in plan.samples_per_rank]


def plan_key(plan):
    return tuple(plan.micro_batch_sizes), tuple(plan.gradient_accumulation_steps)


@dataclass
class PendingSwitch:
    """A switch waiting for its steps at the new plan to be judged (``Rebalancer.judge_switch``)."""

    old_plan: Plan
    new_plan: Plan
    old_models: Optional[list]
    """The models that chose ``old_plan`` (None: it was not chosen by measurements)."""
    before: List[float] = field(default_factory=list)
    """Per-step wall seconds (the slowest rank's) at ``old_plan``, just before the switch."""
    label: str = "switch"
    after: List[float] = field(default_factory=list)
    """Per-step wall seconds at ``new_plan`` so far (checks shorter than ``MIN_STEPS_TO_JUDGE`` add up)."""
    comparing: bool = False
    """The second half of a comparison: the switch to ``old_plan`` observed a slower step within the
    noise, so ``new_plan``, the plan it replaced, runs again for one interval; ``earlier`` holds
    ``new_plan``'s steps from before that switch."""
    earlier: List[float] = field(default_factory=list)


def plan_step_time(models, plan):
    """The slowest rank's predicted step time for ``plan`` under ``models``."""
    return max(g * model.micro_step_time(m)
               for model, m, g in zip(models, plan.micro_batch_sizes, plan.gradient_accumulation_steps))


def scaled_models(reference_models, factors):
    return [TimeModel(ref.a * f, ref.b * f) for ref, f in zip(reference_models, factors)]


class Rebalancer:
    """Rank 0's rebalancing decisions over a training run (pure: no processes).

    Drift is measured against the first whole interval of a plan (the baseline), not against the
    models' predictions: an interval runs one size per rank, which cannot separate a rank's fixed
    cost from its per-sample cost, and a prediction error of the profiled fit at that size would
    read as drift. A device that slows down (throttling, a neighbour) slows all of its compute,
    so the models that chose the plan are scaled by time / baseline: 1 for every rank when
    nothing changed, whatever the split, so noise alone predicts no gain.
    """

    def __init__(self, policy, retry_after_checks=RETRY_AFTER_CHECKS):
        self.policy = policy
        self.reference_models = None  # the time models that chose the plan in force
        self.baseline = None  # per rank (mean, relative error) in the plan's first interval
        self.retry_after_checks = int(retry_after_checks)
        self.pending = None  # a PendingSwitch not judged yet
        self.reverted = {}  # plan_key -> checks during which that plan is not adopted again
        self.startup_plan = None  # the plan in force at start-up (what profiling falls back to)
        self.previous_models = None  # the models that chose the plan before the last adopted one

    # -- checking a switch against what it was meant to improve -------------------------------

    def switched(self, old_plan, new_plan, before, old_models, label):
        """A switch from ``old_plan`` to ``new_plan`` happened; ``before``: per-step wall seconds at
        ``old_plan``. Returns a line for the log (whether and how the switch will be checked)."""
        if not before:
            self.pending = None
            return f"{label}: no step at the old plan was measured, so this switch is not checked"
        self.pending = PendingSwitch(old_plan, new_plan, old_models, list(before), label)
        return None

    def judge_switch(self, plan, after):
        """Judge the pending switch from ``after``, the per-step wall seconds (the slowest rank's)
        at ``plan`` since the switch. Returns None when there is nothing to judge yet (no pending
        switch, or fewer than ``MIN_STEPS_TO_JUDGE`` steps), else a Decision: ``rebalance`` and
        ``revert`` with the old plan when the step got slower beyond the noise.

        A step slower than before but within the noise is not evidence either way, and the plan
        before is the safer one (uniform, after profiling): that plan runs again for one interval,
        and the one of the two whose steps, all counted, have the lower median stays (the other is
        not tried again for ``retry_after_checks`` checks). A plan is never kept on a slower
        observation alone."""
        pending = self.pending
        if pending is None:
            return None
        if plan_key(plan) != plan_key(pending.new_plan):
            self.pending = None
            return None
        pending.after += list(after)
        after = pending.after
        if len(after) < MIN_STEPS_TO_JUDGE:
            return None
        self.pending = None
        if pending.comparing:
            return self._compared(pending, after)
        slowdown, bound = slowdown_beyond_noise(pending.before, after)
        before, now = median(pending.before), median(after)
        observed = (f"{pending.label}: observed step time {before:.4g} s over {len(pending.before)} step(s) at "
                    f"{list(pending.old_plan.micro_batch_sizes)} -> {now:.4g} s over {len(after)} step(s) at "
                    f"{list(plan.micro_batch_sizes)} ({slowdown:+.1%}, noise bound {bound:.1%}; judged "
                    f"scheduler.check_interval steps after the switch)")
        if slowdown <= 0:
            return Decision(False, -slowdown, f"{observed}: kept")
        # A baseline of fewer steps than a judgement needs (profiling's steps at the start-up plan
        # may be one or two, early steps at that) is no evidence against a whole interval: a real
        # 2.5x difference was undone against two such steps. Compare the two plans on more steps.
        short = len(pending.before) < MIN_STEPS_TO_JUDGE
        if slowdown <= bound or short:
            why = ("slower, within the noise" if slowdown <= bound else
                   f"slower, but against {len(pending.before)} step(s) before the switch, too few to judge by")
            # Run the plan before again for one interval; the models that chose this one go along.
            self.pending = PendingSwitch(plan, pending.old_plan, self.reference_models, list(after), pending.label,
                                         comparing=True, earlier=list(pending.before))
            self.plan_chosen(pending.old_models or balanced_models(pending.old_plan))
            return Decision(True, -slowdown, f"{observed}: {why}; back to "
                            f"{list(pending.old_plan.micro_batch_sizes)} for one interval, to compare the two "
                            f"plans on more steps", pending.old_plan, revert=True)
        self.reverted[plan_key(pending.new_plan)] = self.retry_after_checks
        self.plan_chosen(pending.old_models or balanced_models(pending.old_plan))
        return Decision(True, -slowdown, f"{observed}: slower beyond the noise, reverted; "
                        f"{list(plan.micro_batch_sizes)} is not tried again for {self.retry_after_checks} checks",
                        pending.old_plan, revert=True)


    def _compared(self, pending, after):
        """The second half of a comparison: ``pending.new_plan`` (the plan before the switch) ran
        ``after`` now and ``pending.earlier`` before; ``pending.old_plan`` (the switch's) ran
        ``pending.before``. The lower median of all their steps stays."""
        kept, tried = pending.new_plan, pending.old_plan
        kept_steps = list(pending.earlier) + list(after)
        kept_time, tried_time = median(kept_steps), median(pending.before)
        observed = (f"{pending.label}: compared on more steps, {list(kept.micro_batch_sizes)} "
                    f"{kept_time:.4g} s over {len(kept_steps)} step(s), {list(tried.micro_batch_sizes)} "
                    f"{tried_time:.4g} s over {len(pending.before)} step(s)")
        if kept_time <= tried_time:
            self.reverted[plan_key(tried)] = self.retry_after_checks
            return Decision(False, 0.0, f"{observed}: {list(kept.micro_batch_sizes)} stays; "
                            f"{list(tried.micro_batch_sizes)} is not tried again for {self.retry_after_checks} checks")
        self.plan_chosen(pending.old_models or balanced_models(tried))
        return Decision(True, 1.0 - tried_time / kept_time, f"{observed}: back to {list(tried.micro_batch_sizes)}",
                        tried, revert=True)

    def plan_chosen(self, models):
        """A plan chosen by ``models`` is in force from now on; its first interval is the baseline."""
        self.reference_models, self.baseline = models, None

    def check(self, plan, step_times, best_plan_for):
        """One periodic check.

        Args:
            plan: the plan in force.
            step_times: per data-parallel rank, the interval's per-step own times per micro-step
                (the optimizer step's share included, see ``timing.StepTiming``).
            best_plan_for: ``models -> Plan``, the planner with the run's constraints.
        """
        for rank, times in enumerate(step_times):
            if not times:
                raise ValueError(f"data-parallel rank {rank} recorded no micro-steps in the last check interval: its "
                                 f"forward must go through the engine (engine(inputs), not engine.module(inputs)) so "
                                 f"that its micro-steps are timed")
        measured = [interval_statistics(times) for times in step_times]
        if self.baseline is None:
            self.baseline = measured
            if self.reference_models is None:  # no profiling steps: per-sample cost only
                self.reference_models = [TimeModel(0.0, mean / m)
                                         for (mean, _), m in zip(measured, plan.micro_batch_sizes)]
            return Decision(False, 0.0, "baseline of the plan in force measured")
        models = scaled_models(self.reference_models,
                               [mean / base for (mean, _), (base, _) in zip(measured, self.baseline)])
        return self._decide(plan, models, best_plan_for, interval_noise(measured, self.baseline))

    def check_on_demand(self, plan, models, best_plan_for, threshold=None):
        """``reschedule_workload``: adopt the best plan for ``models`` when its predicted gain exceeds
        ``threshold`` (default: the policy's ``imbalance_threshold``), as automatic rebalancing
        requires: a re-plan on demand moves work on the same evidence, not on any predicted gain."""
        if threshold is None:
            if self.policy is None:
                raise ValueError("check_on_demand needs a threshold (scheduler.imbalance_threshold)")
            threshold = self.policy.threshold
        best = best_plan_for(models)
        current = plan_step_time(models, plan)
        gain = predicted_gain(current, best.predicted_step_time)
        if gain > threshold:
            decision = Decision(True, gain, f"on demand, predicted gain {gain:.1%} > threshold {threshold:.0%} "
                                f"(scheduler.imbalance_threshold)")
        else:
            decision = Decision(False, gain, f"on demand, predicted gain {gain:.1%} <= threshold {threshold:.0%} "
                                f"(scheduler.imbalance_threshold)")
        return self._adopt_if_new(plan, best, models, decision)

    def _decide(self, plan, models, best_plan_for, noise):
        best = best_plan_for(models)
        decision = self.policy.check(plan_step_time(models, plan), best.predicted_step_time, noise)
        return self._adopt_if_new(plan, best, models, decision)

    def _adopt_if_new(self, plan, best, models, decision):
        same = (best.micro_batch_sizes, best.gradient_accumulation_steps) == (plan.micro_batch_sizes,
                                                                             plan.gradient_accumulation_steps)
        # A reverted plan stays barred for its number of checks, this one included.
        left = self.reverted.get(plan_key(best), 0)
        self.reverted = {key: count - 1 for key, count in self.reverted.items() if count > 1}
        if not decision.rebalance or same:
            return Decision(False, decision.predicted_gain, decision.reason)
        if left:
            return Decision(False, decision.predicted_gain, f"{decision.reason}, but {list(best.micro_batch_sizes)} "
                            f"made the step slower and was reverted; not tried again for {left - 1} more check(s)")
        self.previous_models = self.reference_models
        self.plan_chosen(models)
        return Decision(True, decision.predicted_gain, decision.reason, best)

    # -- checkpoints (checkpoint.py) ----------------------------------------------------------

    _POLICY_SETTINGS = ("threshold", "cooldown_checks", "consecutive")
    """Policy attributes that come from the config, not from the checks so far: a resumed run
    takes them from its own config."""

    def state_dict(self):
        """Everything the checks so far taught, as plain values: the models that chose the plan in
        force and its baseline interval, the policy's counters (streak, cool-down, ...), the switch
        awaiting its check, the plans reverted and barred for a number of checks, the start-up plan
        profiling falls back to and the models before the last adopted plan."""
        policy = None
        if self.policy is not None:
            policy = {key: value for key, value in vars(self.policy).items()
                      if key not in self._POLICY_SETTINGS and isinstance(value, (bool, int, float, str, list, tuple))}
        pending = self.pending
        return {
            "reference_models": _models_state(self.reference_models),
            "baseline": None if self.baseline is None else [list(entry) for entry in self.baseline],
            "policy": policy,
            "pending": None if pending is None else {
                "old_plan": pending.old_plan.to_dict(), "new_plan": pending.new_plan.to_dict(),
                "old_models": _models_state(pending.old_models), "before": list(pending.before),
                "label": pending.label, "after": list(pending.after), "comparing": pending.comparing,
                "earlier": list(pending.earlier)},
            "reverted": [[list(sizes), list(gas), count] for (sizes, gas), count in self.reverted.items()],
            "startup_plan": None if self.startup_plan is None else self.startup_plan.to_dict(),
            "previous_models": _models_state(self.previous_models),
        }

    def load_state_dict(self, state):
        self.reference_models = _models_from_state(state.get("reference_models"))
        baseline = state.get("baseline")
        self.baseline = None if baseline is None else [tuple(entry) for entry in baseline]
        if self.policy is not None and state.get("policy"):
            for key, value in state["policy"].items():
                if hasattr(self.policy, key) and key not in self._POLICY_SETTINGS:
                    setattr(self.policy, key, value)
        pending = state.get("pending")
        self.pending = None if pending is None else PendingSwitch(
            Plan.from_dict(pending["old_plan"]), Plan.from_dict(pending["new_plan"]),
            _models_from_state(pending["old_models"]), list(pending["before"]), pending["label"],
            list(pending["after"]), bool(pending.get("comparing", False)), list(pending.get("earlier", [])))
        self.reverted = {(tuple(sizes), tuple(gas)): int(count) for sizes, gas, count in state.get("reverted", [])}
        startup = state.get("startup_plan")
        self.startup_plan = None if startup is None else Plan.from_dict(startup)
        self.previous_models = _models_from_state(state.get("previous_models"))


def _models_state(models):
    return None if models is None else [[m.a, m.b] for m in models]


def _models_from_state(values):
    return None if values is None else [TimeModel(a, b) for a, b in values]


def window_models(step_samples, fits, step_overheads, gradient_accumulation_steps):
    """Per-rank models for an on-demand re-plan from the steps since the last check: the profiled
    fits (or a fit of the window's samples without profiling) scaled by measured / predicted time
    over the window (see ``Rebalancer`` for why a and b are not refitted from one size).

    Args:
        step_samples: per rank, the window's micro-steps ``(mbs, seconds, ...)``.
        fits: per-rank fits from profiling, or None.
        step_overheads: per rank, the mean optimizer-step time of the window.
    """
    models = []
    for rank, samples in enumerate(step_samples):
        samples = [s[:2] for s in samples]
        if not samples:
            raise ValueError(f"data-parallel rank {rank} recorded no micro-steps since the last check: its forward "
                             f"must go through the engine (engine(inputs), not engine.module(inputs)) so that its "
                             f"micro-steps are timed; or pass utilization_metrics")
        base = fits[rank] if fits else fit_time_model(samples)
        drift = sum(t for _, t in samples) / sum(base.micro_step_time(m) for m, _ in samples)
        models.append(TimeModel(drift * base.a + step_overheads[rank] / gradient_accumulation_steps,
                                drift * base.b))
    return models


def models_from_utilization(utilization_metrics, plan):
    """Per-rank time models ``0 + b_i * mbs`` from busy seconds per step under ``plan``, for an
    on-demand re-plan: a list in data-parallel rank order, ``{"busy_seconds": [...]}``, or the
    heterogeneous profiler's ``get_metrics()``."""
    busy = utilization_metrics
    if isinstance(busy, dict):
        busy = busy["busy_seconds"] if "busy_seconds" in busy else [rank["busy_s_per_step"]
                                                                    for rank in busy.get("ranks", ())]
    busy = [float(b) for b in busy]
    if len(busy) != plan.world_size or not all(b > 0 for b in busy):
        raise ValueError(f"reschedule_workload: utilization_metrics needs one positive busy time per "
                         f"data-parallel rank ({plan.world_size}), got {busy}")
    return [TimeModel(0.0, b / n) for b, n in zip(busy, plan.samples_per_rank)]
