# SPDX-License-Identifier: Apache-2.0
"""``deepspeed --autotuning tune|run``: the search and its outputs.

1. One profiling experiment (compute_aware, its profiling steps) measures every rank's time and
   activation models and reads each rank's memory capacity (its device, an emulated
   ``memory_gb``, or on CPU its share of the host). It is also a measured experiment.
2. The candidates (ZeRO stage x gas x per-rank micro-batch sizes) are predicted with those
   models (costmodel.py); those predicted not to fit are not run.
3. Real experiments, chosen by the search:
     fast (default)    the best prediction of every stage, then the winning stage's runner-up
     gridsearch        every candidate that fits (fast: false)
     random            a seeded random order, up to tuner_num_trials
     model_based       the best prediction per stage, then candidates by prediction corrected
                       with the measured/predicted ratio of their stage, exploring an untried
                       candidate at random with probability 0.2; stops after
                       tuner_early_stopping experiments without improvement
4. results_dir gets summary.txt, results.json, ds_config_optimal.json (with the per-rank plan in
   heterogeneous_config) and cmd_optimal.txt; exps_dir one folder per experiment.
"""

import copy
import json
import math
import os
import random
import shlex
import shutil
import sys
import time

from deepspeed.utils import logger

from .costmodel import ClusterProfile
from .results import (FAILED, NO_METRICS, OK, OOM, PREDICTED_OOM, PROFILED, TIMEOUT, Outcome, format_summary, is_better,
                      lr_advice, lower_is_better, metric_value, select_best)
from .runner import ExperimentRunner, find_config_path
from .space import AutotuningConfigError, Experiment, interpolate, optimal_ds_config, parse_settings, parse_space

EXPLORATION = 0.2
RESULT_FILES = ("summary.txt", "results.json", "ds_config_optimal.json", "cmd_optimal.txt")
AUTO_MBS_LIMIT_WITHOUT_CAPACITY = 32
PROFILE_STEPS = 5  # fitted from steps 2-5: four points per rank at sizes a quarter apart


class AutotuningError(RuntimeError):
    """Tuning could not produce a configuration; the message says what was tried and why."""


def _say(text):
    print(f"[autotuning] {text}", flush=True)


def _launcher_args(argv, user_script):
    """The launcher's own arguments from the command line, without --autotuning and --master_port."""
    args = list(argv[:argv.index(user_script)]) if user_script in argv else []
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--autotuning", "--master_port"):
            skip = True
            continue
        if arg.startswith("--autotuning=") or arg.startswith("--master_port="):
            continue
        out.append(arg)
    return out


class HeterogeneousAutotuner:

    def __init__(self, args, active_resources, argv):
        self.args = args
        script = args.user_script
        if not script or not os.path.isfile(script):
            raise AutotuningConfigError(f"the training script {script!r} does not exist: give "
                                        f"'deepspeed --autotuning tune [launcher options] train.py --deepspeed_config "
                                        f"ds_config.json ...'")
        self.config_path = find_config_path(args.user_args)
        if self.config_path is None:
            raise AutotuningConfigError("the script's arguments do not name a ds_config: pass it as "
                                        "--deepspeed_config FILE.json (or --deepspeed FILE.json)")
        try:
            with open(self.config_path) as handle:
                self.user_config = json.load(handle)
        except (OSError, ValueError) as exc:
            raise AutotuningConfigError(f"cannot read the ds_config {self.config_path}: {exc}") from exc
        self.settings = parse_settings(self.user_config)
        for flag, value in (("--num_nodes", args.num_nodes), ("--num_gpus", args.num_gpus)):
            if value == 0 or value < -1:
                raise AutotuningConfigError(f"{flag} {value}: give a positive number, or leave it out to use every "
                                            f"node / device found")
        from deepspeed.launcher.runner import apply_num_nodes_and_gpus
        resources = apply_num_nodes_and_gpus(active_resources, args.num_nodes, args.num_gpus)
        self.world_size = sum(len(slots) for slots in resources.values())
        mp = (self.user_config.get("autotuning") or {}).get("mp_size", 1)
        self.dp_world = max(1, self.world_size // max(1, int(mp)))
        self._check_heterogeneous_blocks()
        self.space = parse_space(self.user_config, self.settings, self.dp_world)
        self.results_dir = os.path.abspath(self.settings.results_dir)
        self.exps_dir = os.path.abspath(self.settings.exps_dir)
        self._clear_previous_results()
        self.runner = ExperimentRunner(_launcher_args(argv, script), script, args.user_args,
                                       self.settings.arg_mappings, self.settings.experiment_timeout)
        self.outcomes = []
        self.configs = {}
        self.profile = None
        self.planned = 0
        self.durations = []
        self.interrupted = False
        self.rng = random.Random(self.settings.seed)

    def _check_heterogeneous_blocks(self):
        """The fork's blocks as every experiment's ranks will read them (per-rank lists such as
        emulation speeds against the ranks this command starts), before anything is launched. The
        plan itself (strategy, micro_batch_sizes) is each experiment's own."""
        from deepspeed.runtime.heterogeneous.config import load_heterogeneous_settings
        config = copy.deepcopy(self.user_config)  # the loader moves a top-level "scheduler" alias
        block = config.get("heterogeneous_config")
        if isinstance(block, dict):
            block.pop("micro_batch_sizes", None)
            block.pop("load_balancing_strategy", None)
        try:
            load_heterogeneous_settings(config, world_size=self.dp_world, environ={})
        except ValueError as exc:
            raise AutotuningConfigError(f"{exc} (this command starts {self.world_size} rank(s))") from exc

    def _clear_previous_results(self):
        """Remove an earlier tuning's files (only those: results_dir may be a shared folder)."""
        stale = [os.path.join(self.results_dir, name) for name in RESULT_FILES]
        if os.path.isdir(self.exps_dir):
            stale += [os.path.join(self.exps_dir, name) for name in os.listdir(self.exps_dir)
                      if os.path.isfile(os.path.join(self.exps_dir, name, "cmd.txt"))
                      or os.path.islink(os.path.join(self.exps_dir, name))]
        stale = [path for path in stale if os.path.lexists(path)]
        if stale and not self.settings.overwrite:
            raise AutotuningConfigError(f"results of an earlier tuning are in the way ({stale[0]}, ...) and "
                                        f"autotuning.overwrite is false: move them or set overwrite to true")
        for path in stale:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        if stale:
            _say(f"removed the results of an earlier tuning from {self.results_dir} and {self.exps_dir} "
                 f"(autotuning.overwrite)")
        for folder in (self.results_dir, self.exps_dir):
            os.makedirs(folder, exist_ok=True)

    # -- experiments ----------------------------------------------------------------------------

    def _run(self, experiment, predicted=None, settings=None):
        name = experiment.name
        settings = settings or self.settings
        exp_dir = os.path.join(self.exps_dir, name)
        config = experiment.ds_config(self.user_config, os.path.join(exp_dir, "metrics.json"), settings,
                                      PROFILE_STEPS)
        number = len([o for o in self.outcomes if o.status != PREDICTED_OOM]) + 1
        total = max(self.planned, number)
        counter = f"{number}/{total}" if self.planned else f"{number} (profiling run)"
        elapsed = time.monotonic() - self.began
        eta = (sum(self.durations) / len(self.durations)) * (total - number + 1) if self.durations else None
        _say(f"experiment {counter} {name}: running (elapsed {_clock(elapsed)}, ETA "
             f"{'unknown' if eta is None else _clock(eta)})")
        status, message, metrics, seconds = self.runner.run(experiment, config, exp_dir)
        self.durations.append(seconds)
        value = None
        if status == OK:
            try:
                value = metric_value(metrics, self.settings.metric)
            except ValueError as exc:
                status, message = FAILED, str(exc)
        if status == FAILED and "unrecognized arguments" in message and self.settings.arg_mappings:
            message += (f"\nhint: autotuning.arg_mappings {self.settings.arg_mappings} names flags; the script must "
                        f"accept them")
        outcome = Outcome(name=name, stage=experiment.stage, status=status, value=value, seconds=seconds,
                          error=message, predicted=predicted, train_batch_size=experiment.train_batch_size,
                          micro_batch_sizes=list(experiment.micro_batch_sizes), gas=experiment.gas,
                          metrics=metrics or {}, folder=exp_dir)
        self.outcomes.append(outcome)
        self.configs[name] = config
        with open(os.path.join(exp_dir, "result.json"), "w") as handle:
            json.dump(outcome.to_dict(), handle, indent=2)
        last_line = message.splitlines()[-1] if message else ""
        shown = f"{self.settings.metric} {value:.4g}" if status == OK else f"{status}: {last_line}"
        _say(f"experiment {counter} {name}: {shown} ({seconds:.1f} s)")
        self._check_abort()
        return outcome

    def _check_abort(self):
        """Two script-level failures before any success: the script cannot be tuned; stop."""
        if any(o.status == OK for o in self.outcomes):
            return
        ran = [o for o in self.outcomes if o.status != PREDICTED_OOM]
        if len(ran) >= 2 and all(o.status in (FAILED, NO_METRICS) for o in ran[-2:]):
            self._write_results()
            raise AutotuningError(f"the first experiments failed the same way, so the script cannot be tuned as "
                                  f"given; last error ({ran[-1].name}, {ran[-1].status}):\n{ran[-1].error}\n"
                                  f"logs: {os.path.join(self.exps_dir, ran[-1].name)}; summary: "
                                  f"{os.path.join(self.results_dir, 'results.json')}")

    # -- the search -----------------------------------------------------------------------------

    def tune(self):
        self.began = time.monotonic()
        try:
            self._tune()
        except KeyboardInterrupt:
            self.interrupted = True
            self._write_results()  # what was tried, up to the interruption
            raise

    def _tune(self):
        space = self.space
        sizes = space.micro_batch_sizes or "auto"
        if space.heterogeneous:
            sizes = f"{sizes} (mean per rank: per-rank splits of the same total are tried)"
        _say(f"tuning {self.world_size} rank(s): ZeRO stages {space.stages}, gas {space.gas}, micro-batch sizes "
             f"{sizes}, train_batch_size {space.train_batch_size or 'tuned'}, metric "
             f"{self.settings.metric}, {'fast' if self.settings.fast else self.settings.tuner_type} search")
        self._profile()
        candidates = self._candidates()
        if self.profile is not None:
            predicted = [(e, self.profile.predict(e.stage, e.gas, e.micro_batch_sizes)) for e in candidates]
            for experiment, prediction in predicted:
                if not prediction.fits:
                    self.outcomes.append(Outcome(name=experiment.name, stage=experiment.stage, status=PREDICTED_OOM,
                                                 error="predicted memory "
                                                 f"{[round(m / 2**30, 3) for m in prediction.memory_bytes]} GiB "
                                                 f"exceeds the ranks' limits", gas=experiment.gas,
                                                 micro_batch_sizes=list(experiment.micro_batch_sizes),
                                                 train_batch_size=experiment.train_batch_size))
            fitting = [(e, p) for e, p in predicted if p.fits]
            if not fitting and candidates:
                self._write_results()
                raise AutotuningError("every candidate is predicted out of memory on some rank (see results.json); "
                                      "lower the micro-batch sizes, use a higher ZeRO stage or offload")
            search = {"gridsearch": self._grid, "random": self._random, "model_based": self._model_based}
            (self._fast if self.settings.fast else search[self.settings.tuner_type])(fitting)
        else:
            self._sweep(candidates)
        self._write_results()
        if select_best(self.outcomes, self.settings.metric) is None:
            raise AutotuningError(self._nothing_worked())

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

    def _totals(self, stage, gas):
        """Samples per micro-step (over all ranks) to try at this stage and gas."""
        space, settings = self.space, self.settings
        if space.train_batch_size is not None:
            return [space.train_batch_size // gas]
        if space.micro_batch_sizes is not None:
            sizes = space.micro_batch_sizes
        else:
            top = settings.max_train_micro_batch_size_per_gpu
            caps = self.profile.max_micro_batch(stage) if self.profile else [None]
            known = [c for c in caps if c is not None]
            if known:
                top = min(top, max(1, sum(known) // self.dp_world))
            else:
                top = min(top, AUTO_MBS_LIMIT_WITHOUT_CAPACITY)
            sizes, size = [], settings.min_train_micro_batch_size_per_gpu
            while size <= top:
                sizes.append(size)
                size *= 2
            sizes = sizes[-settings.num_tuning_micro_batch_sizes:]
        totals = []
        for size in sizes:
            total = size * self.dp_world
            batch = total * gas
            if batch < settings.min_train_batch_size:
                continue
            if settings.max_train_batch_size is not None and batch > settings.max_train_batch_size:
                continue
            totals.append(total)
        return totals

    def _candidates(self):
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
        names = {o.name for o in self.outcomes if o.status != PREDICTED_OOM}
        return experiment.name in names

    def _fast(self, fitting):
        ranked = self._ranked(fitting)
        firsts = []
        for stage in self.space.stages:
            mine = [item for item in ranked if item[0].stage == stage]
            if mine:
                firsts.append(mine)
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
        trials = len([o for o in self.outcomes if o.status != PREDICTED_OOM])
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
        """Without a profile: per stage and gas, growing micro-batches until one runs out of
        memory or stops improving the metric."""
        self.planned += len(candidates)
        for stage in self.space.stages:
            for gas in self.space.gas:
                mine = sorted((e for e in candidates if e.stage == stage and e.gas == gas),
                              key=lambda e: e.train_batch_size)
                best = None
                for experiment in mine:
                    if self._already(experiment):
                        continue
                    outcome = self._run(experiment)
                    if outcome.status in (OOM, TIMEOUT):
                        break
                    if outcome.status == OK:
                        if best is not None and not is_better(outcome.value, best, self.settings.metric):
                            break
                        best = outcome.value

    # -- outputs --------------------------------------------------------------------------------

    def _nothing_worked(self):
        counts = {}
        for outcome in self.outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        if counts and set(counts) <= {OOM, PREDICTED_OOM}:
            why = ("every candidate ran out of memory: lower the micro-batch sizes, use a higher ZeRO stage or "
                   "offload optimizer states")
        else:
            last = [o for o in self.outcomes if o.status not in (OK, PREDICTED_OOM, PROFILED)]
            if last:
                why = f"no experiment succeeded; last error ({last[-1].name}, {last[-1].status}):\n{last[-1].error}"
            elif counts:
                why = "no candidate configuration was left to run after the profiling run (see the space above)"
            else:
                why = "no experiment was run"
        return f"{why}\noutcomes: {counts}; details: {os.path.join(self.results_dir, 'results.json')}"

    def _ran(self):
        """Experiments that ran (predicted out-of-memory candidates did not)."""
        return len([o for o in self.outcomes if o.status != PREDICTED_OOM])

    def best(self):
        return select_best(self.outcomes, self.settings.metric)

    def optimal_config(self):
        best = self.best()
        return optimal_ds_config(self.configs[best.name], self.user_config)

    def optimal_command(self):
        from .runner import experiment_args
        best = self.best()
        path = os.path.join(self.results_dir, "ds_config_optimal.json")
        experiment = Experiment(stage=best.stage, gas=best.gas, micro_batch_sizes=tuple(best.micro_batch_sizes))
        return ["deepspeed", *self.runner.launcher_args, self.runner.user_script,
                *experiment_args(self.runner.user_args, path, self.settings.arg_mappings, experiment)]

    def _write_results(self):
        summary = format_summary(self.outcomes, self.settings.metric, self.space.stages)
        if self.interrupted:
            summary = f"INTERRUPTED: partial results, {self._ran()} experiment(s) finished\n{summary}"
        with open(os.path.join(self.results_dir, "summary.txt"), "w") as handle:
            handle.write(summary + "\n")
        with open(os.path.join(self.results_dir, "results.json"), "w") as handle:
            json.dump({"metric": self.settings.metric, "world_size": self.world_size, "interrupted": self.interrupted,
                       "space": {"stages": self.space.stages, "gas": self.space.gas,
                                 "micro_batch_sizes": self.space.micro_batch_sizes,
                                 "train_batch_size": self.space.train_batch_size},
                       "profile": self.profile.summary() if self.profile else None,
                       "tuning_seconds": time.monotonic() - self.began,
                       "experiments": [o.to_dict() for o in self.outcomes]}, handle, indent=2)
        best = self.best()
        if best is None:
            return
        with open(os.path.join(self.results_dir, "ds_config_optimal.json"), "w") as handle:
            json.dump(self.optimal_config(), handle, indent=2)
        with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w") as handle:
            handle.write(" ".join(shlex.quote(a) for a in self.optimal_command()) + "\n")

    def print_tuning_results(self):
        best = self.best()
        print(format_summary(self.outcomes, self.settings.metric, self.space.stages), flush=True)
        ran = len([o for o in self.outcomes if o.status != PREDICTED_OOM])
        folder = f" (folder {best.folder})" if best.folder and os.path.basename(best.folder) != best.name else ""
        _say(f"{ran} experiments in {_clock(time.monotonic() - self.began)}; best {best.name}: "
             f"{self.settings.metric} {best.value:.4g}{folder}")
        if len(set(best.micro_batch_sizes)) > 1:
            _say(f"per-rank micro-batch sizes {best.micro_batch_sizes} (heterogeneous_config in "
                 f"ds_config_optimal.json)")
        advice = lr_advice(self.user_config, best.train_batch_size, self._user_batch())
        if advice:
            _say(advice)
        _say(f"results: {self.results_dir} (ds_config_optimal.json, cmd_optimal.txt, summary.txt, results.json); "
             f"experiments: {self.exps_dir}")

    def _user_batch(self):
        if self.space.train_batch_size is not None:
            return self.space.train_batch_size
        mbs = self.user_config.get("train_micro_batch_size_per_gpu")
        gas = self.user_config.get("gradient_accumulation_steps", 1)
        if isinstance(mbs, int) and isinstance(gas, int) and not isinstance(mbs, bool):
            return mbs * gas * self.dp_world
        return None

    def run_after_tuning(self):
        import subprocess
        from .runner import free_port, remove_shm_buffers
        port = free_port()
        optimal = self.optimal_command()
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)] + optimal[1:]
        _say(f"launching the optimal configuration: {' '.join(optimal)}")
        try:
            return subprocess.call(command)
        finally:
            remove_shm_buffers(port)


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


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def run_autotuning(args, active_resources, argv):
    """Entry point from the launcher; exits with a message instead of a traceback on bad input."""
    import signal

    def _terminate(signum, frame):
        raise KeyboardInterrupt  # a killed tuner still stops its running experiment's process group

    signal.signal(signal.SIGTERM, _terminate)
    # A tuner started in the background by a non-interactive shell inherits SIGINT ignored, and
    # Python then never raises KeyboardInterrupt: Ctrl-C/SIGINT must still stop the experiment.
    signal.signal(signal.SIGINT, _terminate)
    tuner = None
    try:
        tuner = HeterogeneousAutotuner(args, active_resources, argv)
        tuner.tune()
        tuner.print_tuning_results()
    except (AutotuningConfigError, AutotuningError) as exc:
        print(f"deepspeed autotuning: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(exc, AutotuningConfigError) else 1)
    except KeyboardInterrupt:
        where = ""
        if tuner is not None and tuner._ran():
            where = (f"; partial results of the {tuner._ran()} finished experiment(s) in {tuner.results_dir} "
                     f"(results.json has \"interrupted\": true)")
        print(f"deepspeed autotuning: interrupted; the running experiment was stopped{where}", file=sys.stderr,
              flush=True)
        sys.exit(130)
    logger.info(f"autotuning results in {tuner.results_dir}")
    if args.autotuning == "run":
        sys.exit(tuner.run_after_tuning())
