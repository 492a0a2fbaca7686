# SPDX-License-Identifier: Apache-2.0
"""The outputs of ``deepspeed --autotuning tune|run`` (step 4 of tuner.py's outline): progress
lines, results_dir's files, the optimal ds_config and command, and the final report."""

import json
import os
import shlex
import time

from .results import NOT_RUN, OK, OOM, PROFILED, format_summary, lr_advice, select_best
from .experiment import Experiment, optimal_ds_config

RESULT_FILES = ("summary.txt", "results.json", "ds_config_optimal.json", "cmd_optimal.txt")


def _say(text):
    print(f"[autotuning] {text}", flush=True)


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class TuningOutputs:
    """The outputs half of ``HeterogeneousAutotuner`` (tuner.py), which owns the state they report
    (outcomes, configs, settings, space, profile, user_config, world_size, dp_world, runner,
    results_dir, exps_dir, began, interrupted)."""

    def _nothing_worked(self):
        counts = {}
        for outcome in self.outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        if counts and set(counts) <= {OOM, *NOT_RUN}:
            why = ("every candidate ran out of memory: lower the micro-batch sizes, use a higher ZeRO stage or "
                   "offload optimizer states")
        else:
            last = [o for o in self.outcomes if o.status not in (OK, PROFILED, *NOT_RUN)]
            if last:
                why = f"no experiment succeeded; last error ({last[-1].name}, {last[-1].status}):\n{last[-1].error}"
            elif counts:
                why = "no candidate configuration was left to run after the profiling run (see the space above)"
            else:
                why = "no experiment was run"
        return f"{why}\noutcomes: {counts}; details: {os.path.join(self.results_dir, 'results.json')}"

    def _ran(self):
        """Experiments that ran (candidates predicted out of memory or pruned did not)."""
        return len([o for o in self.outcomes if o.status not in NOT_RUN])

    def best(self):
        return select_best(self.outcomes, self.settings.metric)

    def optimal_config(self):
        best = self.best()
        return optimal_ds_config(self.configs[best.name], self.user_config)

    def optimal_command(self):
        from .runner import experiment_args
        best = self.best()
        path = os.path.join(self.results_dir, "ds_config_optimal.json")
        experiment = Experiment(stage=best.stage, gas=best.gas, micro_batch_sizes=tuple(best.micro_batch_sizes),
                                pipeline_stages=best.pipeline_stages, partition=best.partition)
        return ["deepspeed", *self.runner.launcher_args, self.runner.user_script,
                *experiment_args(self.runner.user_args, path, self.settings.arg_mappings, experiment)]

    def _summary(self):
        points = self.space.pipeline.points() if self.space.pipeline is not None else ()
        return format_summary(self.outcomes, self.settings.metric, self.space.stages, points)

    def _write_results(self):
        summary = self._summary()
        if self.interrupted:
            summary = f"INTERRUPTED: partial results, {self._ran()} experiment(s) finished\n{summary}"
        with open(os.path.join(self.results_dir, "summary.txt"), "w") as handle:
            handle.write(summary + "\n")
        with open(os.path.join(self.results_dir, "results.json"), "w") as handle:
            json.dump({"metric": self.settings.metric, "world_size": self.world_size, "interrupted": self.interrupted,
                       "space": {"stages": self.space.stages, "gas": self.space.gas,
                                 "micro_batch_sizes": self.space.micro_batch_sizes,
                                 "train_batch_size": self.space.train_batch_size,
                                 "pipeline": None if self.space.pipeline is None else {
                                     "num_stages": list(self.space.pipeline.degrees),
                                     "partition": list(self.space.pipeline.partitions),
                                     "flag": self.space.pipeline.flag}},
                       "notes": self.space.notes,
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
        print(self._summary(), flush=True)
        ran = len([o for o in self.outcomes if o.status not in NOT_RUN])
        folder = f" (folder {best.folder})" if best.folder and os.path.basename(best.folder) != best.name else ""
        _say(f"{ran} experiments in {_clock(time.monotonic() - self.began)}; best {best.name}: "
             f"{self.settings.metric} {best.value:.4g}{folder}")
        if best.pipeline_stages is not None:
            replicas = len(best.micro_batch_sizes)
            cut = (f"partition {best.partition} (heterogeneous_config.pipeline.partition in ds_config_optimal.json)"
                   if best.partition else "one stage, no cut")
            _say(f"pipeline: {best.pipeline_stages} stage(s) x {replicas} replica(s), {cut}; cmd_optimal.txt passes "
                 f"{self.space.pipeline.flag} {best.pipeline_stages}")
            if replicas > 1:
                _say(f"per-replica micro-batch sizes {best.micro_batch_sizes} (compute_aware: the engine makes this "
                     f"plan from the replicas' speeds as it starts)")
        elif len(set(best.micro_batch_sizes)) > 1:
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
        if self.space.pipeline is not None:
            return None  # the user's replicas depend on their script's degree, which the config does not say
        mbs = self.user_config.get("train_micro_batch_size_per_gpu")
        gas = self.user_config.get("gradient_accumulation_steps", 1)
        if isinstance(mbs, int) and isinstance(gas, int) and not isinstance(mbs, bool):
            return mbs * gas * self.dp_world
        return None
