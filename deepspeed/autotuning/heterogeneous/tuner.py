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

With ``autotuning.pipeline`` (a PipelineModule), steps 1-2 do not apply: the pipeline engine runs
no profiling steps and the cost model knows no stages, so every candidate (degree x partition x
ZeRO 0/1 x gas x micro-batch) is measured, a sweep per group; the degree reaches the script by its
``arg_mappings`` flag, in every experiment and in cmd_optimal.txt.

This module is the command-line entry, the checks made before anything is launched and the
experiment loop; search.py holds steps 1-3 (profiling, candidates, strategies), outputs.py step 4.
"""

import copy
import json
import os
import random
import shutil
import sys
import time

from deepspeed.utils import logger

from .experiment import replica_micro_batches
from .outputs import RESULT_FILES, TuningOutputs, _clock, _say
from .results import FAILED, NO_METRICS, NOT_RUN, OK, PREDICTED_OOM, Outcome, metric_value, select_best
from .runner import ExperimentRunner, find_config_path
# EXPLORATION and choose_next are re-exported: the tests import them from this module.
from .search import EXPLORATION, PROFILE_STEPS, TuningSearch, choose_next  # noqa: F401
from .settings import AutotuningConfigError, parse_settings
from .space import parse_space


class AutotuningError(RuntimeError):
    """Tuning could not produce a configuration; the message says what was tried and why."""


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


def _master_port(argv, user_script):
    """The launcher's --master_port on the command line (the experiments count up from it), or None."""
    args = list(argv[:argv.index(user_script)]) if user_script in argv else list(argv)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--master_port=") else (
            args[i + 1] if arg == "--master_port" and i + 1 < len(args) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise AutotuningConfigError(f"--master_port {value!r}: use a port number") from None
    return None


def _resources_in_use(active_resources, num_nodes, num_gpus):
    """The hosts and slots each experiment's launch uses: the first ``num_nodes`` hosts (all when
    not positive) and slots ``0 .. num_gpus - 1`` on each (their own slots when not positive), as
    the launcher trims them after the tuner hands it the flags."""
    hosts = list(active_resources.items())
    if num_nodes > 0:
        hosts = hosts[:num_nodes]
    return {host: list(range(num_gpus)) if num_gpus > 0 else list(slots) for host, slots in hosts}


class HeterogeneousAutotuner(TuningSearch, TuningOutputs):

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
        self.world_size = sum(len(slots) for slots in _resources_in_use(active_resources, args.num_nodes,
                                                                          args.num_gpus).values())
        mp = (self.user_config.get("autotuning") or {}).get("mp_size", 1)
        self.dp_world = max(1, self.world_size // max(1, int(mp)))
        self._check_heterogeneous_blocks()
        self.space = parse_space(self.user_config, self.settings, self.dp_world)
        self.results_dir = os.path.abspath(self.settings.results_dir)
        self.exps_dir = os.path.abspath(self.settings.exps_dir)
        self._clear_previous_results()
        self.runner = ExperimentRunner(_launcher_args(argv, script), script, args.user_args,
                                       self.settings.arg_mappings, self.settings.experiment_timeout,
                                       base_port=_master_port(argv, script))
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
        from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
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
        number = len([o for o in self.outcomes if o.status not in NOT_RUN]) + 1
        # The search plans stage by stage, so the total grows as it goes: a count that reached its
        # total and went on ("3/3, 4/4") would read as finished.
        total = max(self.planned, number)
        counter = f"{number} of {total} planned so far" if self.planned else f"{number} (profiling run)"
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
        sizes = list(experiment.micro_batch_sizes)
        if experiment.pipeline_stages is not None and metrics:
            # The replicas' plan the engine made from their speeds (the name keeps the even split).
            sizes = replica_micro_batches(metrics, len(sizes)) or sizes
        outcome = Outcome(name=name, stage=experiment.stage, status=status, value=value, seconds=seconds,
                          error=message, predicted=predicted, train_batch_size=experiment.train_batch_size,
                          micro_batch_sizes=sizes, gas=experiment.gas, metrics=metrics or {}, folder=exp_dir,
                          pipeline_stages=experiment.pipeline_stages, partition=experiment.partition)
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
        ran = [o for o in self.outcomes if o.status not in NOT_RUN]
        if len(ran) >= 2 and all(o.status in (FAILED, NO_METRICS) for o in ran[-2:]):
            self._write_results()
            raise AutotuningError(f"the first experiments failed the same way, so the script cannot be tuned as "
                                  f"given; last error ({ran[-1].name}, {ran[-1].status}):\n{ran[-1].error}\n"
                                  f"logs: {os.path.join(self.exps_dir, ran[-1].name)}; summary: "
                                  f"{os.path.join(self.results_dir, 'results.json')}")

    # -- the search -----------------------------------------------------------------------------

    def tune(self):
        from .runner import remove_orphaned_shm_buffers
        self.began = time.monotonic()
        try:
            self._tune()
        except KeyboardInterrupt:
            self.interrupted = True
            self._write_results()  # what was tried, up to the interruption
            raise
        finally:
            # Whatever a killed rank left in /dev/shm (66 MiB each), from this tuning or before it.
            removed = remove_orphaned_shm_buffers()
            if removed:
                _say(f"removed {len(removed)} shared-memory buffer(s) that killed ranks left in /dev/shm")

    def _tune(self):
        space = self.space
        sizes = space.micro_batch_sizes or "auto"
        if space.heterogeneous:
            sizes = f"{sizes} (mean per rank: per-rank splits of the same total are tried)"
        if space.pipeline is not None:
            self._tune_pipeline()
            return
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

    def _tune_pipeline(self):
        """The pipeline engine fixes its replicas' plan as it starts and runs no profiling steps,
        and the cost model knows no stages: every candidate is measured (a sweep per degree,
        partition, ZeRO stage and gas), none predicted."""
        space = self.space
        pipeline = space.pipeline
        gas = space.gas if not space.gas_by_degree else {f"pp{d}": g for d, g in space.gas_by_degree.items()}
        _say(f"tuning {self.world_size} rank(s): pipeline degrees {list(pipeline.degrees)} (script flag "
             f"{pipeline.flag}), partitions {list(pipeline.partitions)}, ZeRO stages {space.stages}, gas {gas}, "
             f"micro-batch sizes {space.micro_batch_sizes or 'auto'} (per replica; compute_aware splits by the "
             f"replicas' speeds), train_batch_size {space.train_batch_size or 'tuned'}, metric "
             f"{self.settings.metric}")
        for note in space.notes:
            _say(f"note: {note}")
        _say("pipeline: no profiling run (the pipeline engine runs no profiling steps); every candidate is measured")
        self._sweep(self._candidates())
        self._write_results()
        if select_best(self.outcomes, self.settings.metric) is None:
            raise AutotuningError(self._nothing_worked())

    # -- run: the optimal configuration (--autotuning run) --------------------------------------

    def run_after_tuning(self):
        import subprocess
        from .runner import remove_shm_buffers
        port = self.runner.next_port()
        optimal = self.optimal_command()
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)] + optimal[1:]
        _say(f"launching the optimal configuration: {' '.join(optimal)}")
        try:
            return subprocess.call(command)
        finally:
            remove_shm_buffers(port)


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
