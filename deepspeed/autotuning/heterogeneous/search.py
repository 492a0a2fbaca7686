# SPDX-License-Identifier: Apache-2.0
"""The search of ``deepspeed --autotuning tune|run`` (steps 1-3 of tuner.py's outline): the
profiling run, the candidates (ZeRO stage x gas x per-rank micro-batch sizes, and with
``autotuning.pipeline`` the pipeline degree x partition) and the strategies that choose which of
them run (fast, gridsearch, random, model_based; a sweep without a profile, and with a pipeline).
"""

import math
import os

from .costmodel import ClusterProfile
from .outputs import _say
from .results import (NOT_RUN, OK, OOM, PROFILED, PRUNED, TIMEOUT, Outcome, is_better, lower_is_better,
                      select_best)
from .experiment import Experiment, interpolate

EXPLORATION = 0.2
AUTO_MBS_LIMIT_WITHOUT_CAPACITY = 32
PROFILE_STEPS = 5  # fitted from steps 2-5: four points per rank at sizes a quarter apart


class TuningSearch:
    """The search half of ``HeterogeneousAutotuner`` (tuner.py), which owns the state it reads and
    sets (space, settings, dp_world, user_config, exps_dir, profile, outcomes, configs, planned,
    rng) and runs each chosen experiment with ``_run``."""

    def _profile(self):
        space = self.space
        gas = space.gas[0]
        if space.train_batch_size is not None:
            per_step = space.train_batch_size // gas
        else:
            # The fit a + b * mbs is used at the candidates' sizes: profile near their middle (the
            # largest could run out of memory before anything is known).
            sizes = space.micro_batch_sizes or [max(2, self.settings.min_train_micro_batch_size_per_gpu)]
            per_step = sizes[(len(sizes) - 1) // 2] * self.dp_world
        stage = space.stages[0]
        experiment = Experiment(stage=stage, gas=gas, micro_batch_sizes=_even_split(per_step, self.dp_world),
                                profile=True)
        settings = _shifted(self.settings, PROFILE_STEPS)
        outcome = self._run(experiment, settings=settings)
        self.planned = 1
        if outcome.status != OK:
            _say(f"the profiling run failed ({outcome.status}); tuning without predictions")
            return
        try:
            self.profile = ClusterProfile.from_metrics(outcome.metrics)
        except (ValueError, KeyError, TypeError) as exc:
            _say(f"no usable profile ({exc}); tuning without predictions")
            return
        plan = (outcome.metrics.get("profile") or {}).get("plan") or {}
        sizes = plan.get("micro_batch_sizes")
        if not self.space.heterogeneous:
            # The user's config does not enable heterogeneous_config: the profiling run's
            # compute-aware plan only measured the ranks; it is not a candidate.
            outcome.status = PROFILED
        elif sizes:
            # The profiling run measured the compute-aware plan it ended on: name and keep it as that
            # experiment, so it can win and ds_config_optimal.json can reproduce it.
            ran = Experiment(stage=stage, gas=gas, micro_batch_sizes=tuple(sizes), heterogeneous=True)
            outcome.name, outcome.micro_batch_sizes = ran.name, list(sizes)
            self.configs[ran.name] = ran.ds_config(self.user_config, "metrics.json", self.settings)
            link = os.path.join(self.exps_dir, ran.name)
            shown = f"folder {outcome.folder}"
            try:
                if not os.path.lexists(link):  # the summary names it: its folder can be found by that name
                    os.symlink(os.path.basename(outcome.folder), link)
                if os.path.realpath(link) == os.path.realpath(outcome.folder):
                    shown = f"{link} -> {os.path.basename(outcome.folder)}"
            except OSError:
                pass  # no symbolic links here: results.json and the best line name the folder
            _say(f"the profiling run ended on plan {list(sizes)}: it counts as experiment {ran.name} ({shown})")
        mixed = self.profile.heterogeneous
        _say(f"profile: {'heterogeneous' if mixed else 'homogeneous'} cluster")
        for row in self.profile.summary():
            _say(f"  {row}")

    def _totals(self, stage, gas, ranks=None):
        """Samples per micro-step (over all ranks, or a pipeline's ``ranks`` replicas) to try at
        this stage and gas."""
        space, settings = self.space, self.settings
        ranks = ranks or self.dp_world
        if space.train_batch_size is not None:
            return [space.train_batch_size // gas]
        if space.micro_batch_sizes is not None:
            sizes = space.micro_batch_sizes
        else:
            top = settings.max_train_micro_batch_size_per_gpu
            caps = self.profile.max_micro_batch(stage) if self.profile else [None]
            known = [c for c in caps if c is not None]
            if known:
                top = min(top, max(1, sum(known) // ranks))
            else:
                top = min(top, AUTO_MBS_LIMIT_WITHOUT_CAPACITY)
            sizes, size = [], settings.min_train_micro_batch_size_per_gpu
            while size <= top:
                sizes.append(size)
                size *= 2
            sizes = sizes[-settings.num_tuning_micro_batch_sizes:]
        totals = []
        for size in sizes:
            total = size * ranks
            batch = total * gas
            if batch < settings.min_train_batch_size:
                continue
            if settings.max_train_batch_size is not None and batch > settings.max_train_batch_size:
                continue
            totals.append(total)
        return totals

    def _candidates(self):
        if self.space.pipeline is not None:
            return self._pipeline_candidates()
        mixed = self.space.heterogeneous and self.profile is not None and self.profile.heterogeneous
        seen, out = set(), []
        for stage in self.space.stages:
            for gas in self.space.gas:
                for total in self._totals(stage, gas):
                    for sizes in self._allocations(stage, gas, total, mixed):
                        experiment = Experiment(stage=stage, gas=gas, micro_batch_sizes=sizes,
                                                heterogeneous=self.space.heterogeneous)
                        if experiment.name not in seen:
                            seen.add(experiment.name)
                            out.append(experiment)
        return out

    def _pipeline_candidates(self):
        """Per (degree, partition), stage and gas: an even split over the degree's replicas (the
        engine's compute_aware replica plan re-splits it by the replicas' speeds)."""
        out = []
        for degree, partition in self.space.pipeline.points():
            replicas = self.space.replicas(degree)
            for stage in self.space.stages:
                for gas in self.space.gas_for(degree):
                    for total in self._totals(stage, gas, replicas):
                        if total % replicas == 0:
                            out.append(Experiment(stage=stage, gas=gas, micro_batch_sizes=_even_split(total, replicas),
                                                  heterogeneous=True, pipeline_stages=degree, partition=partition))
        return out

    def _allocations(self, stage, gas, total, mixed):
        even = _even_split(total, self.dp_world)
        if not mixed:
            return [even] if total % self.dp_world == 0 else []
        balanced = self.profile.balanced_sizes(stage, gas, total)
        allocations = [even] if total % self.dp_world == 0 else []
        if balanced is not None:
            for fraction in (0.5, 1.0, 1.5):
                sizes = interpolate(even, balanced, fraction)
                if sizes is not None and sizes not in allocations:
                    allocations.append(sizes)
        return allocations

    def _ranked(self, fitting):
        reverse = not lower_is_better(self.settings.metric)
        return sorted(fitting, key=lambda item: item[1].metric(self.settings.metric), reverse=reverse)

    def _already(self, experiment):
        names = {o.name for o in self.outcomes if o.status not in NOT_RUN}
        return experiment.name in names

    def _fast(self, fitting):
        ranked = self._ranked(fitting)
        firsts = []
        for stage in self.space.stages:
            mine = [item for item in ranked if item[0].stage == stage]
            if mine:
                firsts.append(mine)
        firsts = self._pruned(firsts)
        self.planned += len([mine for mine in firsts if not self._already(mine[0][0])])
        for mine in firsts:
            experiment, prediction = mine[0]
            if not self._already(experiment):
                self._run(experiment, prediction.metric(self.settings.metric))
        best = select_best(self.outcomes, self.settings.metric)
        if best is None:
            return
        runner_up = [item for item in ranked if item[0].stage == best.stage and not self._already(item[0])]
        if runner_up:
            self.planned += 1
            experiment, prediction = runner_up[0]
            self._run(experiment, prediction.metric(self.settings.metric))

    def _pruned(self, firsts):
        """Fast mode's stages (each a ranked list of ``(experiment, prediction)``) less those the plan
        rules out (``autotuning.plan_pruning``; false: none), each recorded as PRUNED with its reason:
        ZeRO-3 where ZeRO-2 is predicted to fit ZeRO-3's best candidate. ZeRO-3 steps the same optimizer
        partition and adds a parameter all-gather in every micro-step's forward and backward (and their
        hooks), so at the same micro-batches it cannot be faster.

        The predicted step times do not rank the stages: they count the bytes each stage sends, not
        ZeRO-3's per-module gathers and hooks, which measured on CPU ranks cost more than its bytes
        (docs/autotuning.md)."""
        if not self.settings.plan_pruning or len(firsts) < 2:
            return firsts
        return self._dominated(firsts)

    def _dominated(self, firsts):
        by_stage = {mine[0][0].stage: mine for mine in firsts}
        if 3 not in by_stage or 2 not in by_stage:
            return firsts
        experiment, prediction = by_stage[3][0]
        same = [(e, p) for e, p in by_stage[2]
                if (e.gas, tuple(e.micro_batch_sizes)) == (experiment.gas, tuple(experiment.micro_batch_sizes))]
        if not same or self._already(experiment):
            return firsts
        why = (f"ZeRO-2 is predicted to fit its micro-batches {list(experiment.micro_batch_sizes)} (gas "
               f"{experiment.gas}); ZeRO-3 steps the same optimizer partition and adds a parameter all-gather in "
               f"every micro-step's forward and backward, so it cannot be faster there (autotuning.plan_pruning "
               f"false runs it)")
        self._prune(experiment, prediction.metric(self.settings.metric), why)
        return [mine for mine in firsts if mine is not by_stage[3]]

    def _prune(self, experiment, predicted, why):
        _say(f"pruned {experiment.name}: {why}")
        self.outcomes.append(Outcome(name=experiment.name, stage=experiment.stage, status=PRUNED, error=why,
                                     predicted=predicted, gas=experiment.gas,
                                     micro_batch_sizes=list(experiment.micro_batch_sizes),
                                     train_batch_size=experiment.train_batch_size))

    def _grid(self, fitting):
        todo = [item for item in fitting if not self._already(item[0])]
        self.planned += len(todo)
        for experiment, prediction in todo:
            self._run(experiment, prediction.metric(self.settings.metric))

    def _random(self, fitting):
        todo = [item for item in fitting if not self._already(item[0])]
        self.rng.shuffle(todo)
        todo = todo[:self.settings.tuner_num_trials]
        self.planned += len(todo)
        for experiment, prediction in todo:
            self._run(experiment, prediction.metric(self.settings.metric))

    def _model_based(self, fitting):
        metric = self.settings.metric
        ranked = self._ranked(fitting)
        todo = [item for item in ranked if not self._already(item[0])]
        by_name = {e.name: p for e, p in fitting}
        self.planned += min(len(todo), self.settings.tuner_num_trials)
        for stage in self.space.stages:  # one measurement per stage to learn its correction
            mine = [item for item in todo if item[0].stage == stage]
            if mine:
                todo.remove(mine[0])
                self._run(mine[0][0], mine[0][1].metric(metric))
        best = select_best(self.outcomes, metric)
        stale = 0
        trials = len([o for o in self.outcomes if o.status not in NOT_RUN])
        while todo and stale < self.settings.tuner_early_stopping and trials < self.settings.tuner_num_trials:
            index = choose_next(todo, self._corrections(by_name), metric, self.rng)
            experiment, prediction = todo.pop(index)
            outcome = self._run(experiment, prediction.metric(metric))
            trials += 1
            if outcome.status == OK and (best is None or is_better(outcome.value, best.value, metric)):
                best, stale = outcome, 0
            else:
                stale += 1

    def _corrections(self, by_name):
        """Per stage, measured / predicted metric of its successful experiments (geometric mean)."""
        ratios = {}
        for outcome in self.outcomes:
            predicted = outcome.predicted if outcome.predicted is not None else (
                by_name[outcome.name].metric(self.settings.metric) if outcome.name in by_name else None)
            if outcome.status == OK and predicted:
                ratios.setdefault(outcome.stage, []).append(outcome.value / predicted)
        return {stage: math.exp(sum(math.log(r) for r in values) / len(values)) for stage, values in ratios.items()}

    def _sweep(self, candidates):
        """Without a profile: per (pipeline degree and partition,) stage and gas, growing
        micro-batches until one runs out of memory or stops improving the metric."""
        self.planned += len(candidates)
        groups = {}
        for experiment in candidates:
            key = (experiment.pipeline_stages, experiment.partition, experiment.stage, experiment.gas)
            groups.setdefault(key, []).append(experiment)
        for group in groups.values():  # in the candidates' order: stage, then gas
            best = None
            for experiment in sorted(group, key=lambda e: e.train_batch_size):
                if self._already(experiment):
                    continue
                outcome = self._run(experiment)
                if outcome.status in (OOM, TIMEOUT):
                    break
                if outcome.status == OK:
                    if best is not None and not is_better(outcome.value, best, self.settings.metric):
                        break
                    best = outcome.value


def choose_next(todo, corrections, metric, rng):
    """Index into ``todo`` [(experiment, prediction)] of the next experiment: the best corrected
    prediction, or (probability EXPLORATION) a random other candidate."""
    if not todo:
        raise ValueError("no candidate left")
    default = (sum(corrections.values()) / len(corrections)) if corrections else 1.0

    def score(item):
        experiment, prediction = item
        return prediction.metric(metric) * corrections.get(experiment.stage, default)

    order = sorted(range(len(todo)), key=lambda i: score(todo[i]), reverse=not lower_is_better(metric))
    if len(order) > 1 and rng.random() < EXPLORATION:
        return rng.choice(order[1:])  # explore: not the model's choice
    return order[0]


def _even_split(total, world):
    base, extra = divmod(total, world)
    return tuple(base + (1 if rank < extra else 0) for rank in range(world))


def _shifted(settings, profile_steps):
    """The profiling run's window starts after its profiling steps."""
    import dataclasses
    start = max(settings.start_profile_step, profile_steps + 1)
    return dataclasses.replace(settings, start_profile_step=start,
                               end_profile_step=start + settings.end_profile_step - settings.start_profile_step)
