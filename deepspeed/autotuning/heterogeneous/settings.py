# SPDX-License-Identifier: Apache-2.0
"""The ``autotuning`` block of the user's ds_config as ``Settings`` (pure), and the ds_config keys
the autotuner reads and writes.

Every key of the block is checked by name (``AUTOTUNING_KEYS``: upstream's and the fork's); a
wrong key or value is an ``AutotuningConfigError`` that names it. The tuning space the block and
the config describe is ``space.py``'s.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

AUTO = "auto"
MBS = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH = "train_batch_size"
ZERO = "zero_optimization"
HETERO = "heterogeneous_config"
PIPELINE = "pipeline"
NUM_STAGES = "pipeline.num_stages"
"""The arg_mappings key of the pipeline degree: PipelineModule(num_stages=...) is the script's."""

# Keys of the autotuning block: upstream's, and the fork's additions (documented in the README).
AUTOTUNING_KEYS = {
    "enabled": "bool",
    "fast": "bool",
    "metric": "'throughput', 'latency' or 'flops'",
    "arg_mappings": "a map from ds_config key to the script's flag",
    "results_dir": "a directory",
    "exps_dir": "a directory",
    "overwrite": "bool",
    "start_profile_step": "int >= 0",
    "end_profile_step": "int > start_profile_step",
    "metric_path": "a file (set per experiment by the tuner)",
    "model_info_path": "a file",
    "model_info": "a map (upstream; not used)",
    "tuner_type": "'gridsearch', 'random' or 'model_based'",
    "tuner_early_stopping": "int >= 1",
    "tuner_num_trials": "int >= 1",
    "mp_size": "int >= 1",
    "max_train_batch_size": "int",
    "min_train_batch_size": "int",
    "max_train_micro_batch_size_per_gpu": "int >= 1",
    "min_train_micro_batch_size_per_gpu": "int >= 1",
    "num_tuning_micro_batch_sizes": "int >= 1",
    "experiment_timeout": "seconds > 0 (default 1800)",
    "seed": "int (random and model_based tuners)",
    "plan_pruning": "bool (default true): fast mode skips ZeRO-3 where ZeRO-2 is predicted to fit its best "
                    "candidate",
    MBS: "'auto', an int or a list of ints",
    GAS: "'auto', an int or a list of ints",
    ZERO: "{'stage': int or list of 0-3}",
    PIPELINE: "{'num_stages': int or list of ints, 'partition': name or list of 'balanced', 'parameters', "
              "'uniform'}",
}
METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")


class AutotuningConfigError(ValueError):
    """The autotuning settings or the tuning space are wrong; the message names the key."""


@dataclass
class Settings:
    fast: bool = True
    metric: str = "throughput"
    arg_mappings: Dict[str, str] = field(default_factory=dict)
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    max_train_batch_size: Optional[int] = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    experiment_timeout: float = 1800.0
    seed: int = 0
    plan_pruning: bool = True
    """Fast mode: skip ZeRO-3 where the memory model predicts ZeRO-2 fits ZeRO-3's best candidate (ZeRO-3
    then does the same work and more); false: run every stage's best."""


def _int(value, key, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise AutotuningConfigError(f"autotuning.{key} = {value!r}: must be an integer >= {low}")
    return value


def parse_settings(ds_config):
    """The ``autotuning`` block as Settings; AutotuningConfigError names a wrong key or value."""
    block = ds_config.get("autotuning")
    if not isinstance(block, dict):
        raise AutotuningConfigError("the ds_config has no 'autotuning' block: add \"autotuning\": {\"enabled\": true} "
                                    "(see the README's autotuning section)")
    unknown = sorted(set(block) - set(AUTOTUNING_KEYS))
    if unknown:
        raise AutotuningConfigError(f"autotuning: unknown key(s) {unknown}; allowed keys: "
                                    f"{', '.join(sorted(AUTOTUNING_KEYS))}")
    settings = Settings()
    for key in ("fast", "overwrite", "plan_pruning"):
        if key in block:
            if not isinstance(block[key], bool):
                raise AutotuningConfigError(f"autotuning.{key} = {block[key]!r}: must be true or false")
            setattr(settings, key, block[key])
    if "metric" in block:
        if block["metric"] not in METRICS:
            raise AutotuningConfigError(f"autotuning.metric = {block['metric']!r}: use one of {', '.join(METRICS)}")
        settings.metric = block["metric"]
    if "tuner_type" in block:
        if block["tuner_type"] not in TUNERS:
            raise AutotuningConfigError(f"autotuning.tuner_type = {block['tuner_type']!r}: use one of "
                                        f"{', '.join(TUNERS)}")
        settings.tuner_type = block["tuner_type"]
    mappings = block.get("arg_mappings") or {}
    if not isinstance(mappings, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.startswith("-")
                                                 for k, v in mappings.items()):
        raise AutotuningConfigError(f"autotuning.arg_mappings = {mappings!r}: must map ds_config keys to the "
                                    f"script's flags, e.g. {{\"{MBS}\": \"--per_device_train_batch_size\"}}")
    bad = sorted(set(mappings) - {MBS, GAS, BATCH, NUM_STAGES})
    if bad:
        raise AutotuningConfigError(f"autotuning.arg_mappings: {bad} cannot be mapped; mappable keys: {MBS}, {GAS}, "
                                    f"{BATCH}, {NUM_STAGES}")
    settings.arg_mappings = dict(mappings)
    for key in ("results_dir", "exps_dir"):
        if key in block:
            if not isinstance(block[key], str) or not block[key]:
                raise AutotuningConfigError(f"autotuning.{key} = {block[key]!r}: must be a non-empty path")
            setattr(settings, key, block[key])
    for key, low in (("start_profile_step", 0), ("end_profile_step", 1), ("tuner_early_stopping", 1),
                     ("tuner_num_trials", 1), ("min_train_batch_size", 1), ("max_train_micro_batch_size_per_gpu", 1),
                     ("min_train_micro_batch_size_per_gpu", 1), ("num_tuning_micro_batch_sizes", 1), ("seed", 0)):
        if key in block and block[key] is not None:
            setattr(settings, key, _int(block[key], key, low))
    if block.get("max_train_batch_size") is not None:
        settings.max_train_batch_size = _int(block["max_train_batch_size"], "max_train_batch_size", 1)
    if settings.end_profile_step <= settings.start_profile_step:
        raise AutotuningConfigError(f"autotuning.end_profile_step ({settings.end_profile_step}) must exceed "
                                    f"start_profile_step ({settings.start_profile_step}): the metric is the mean "
                                    f"over the steps between them")
    if settings.min_train_micro_batch_size_per_gpu > settings.max_train_micro_batch_size_per_gpu:
        raise AutotuningConfigError("autotuning.min_train_micro_batch_size_per_gpu exceeds "
                                    "max_train_micro_batch_size_per_gpu")
    if "experiment_timeout" in block:
        value = block["experiment_timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise AutotuningConfigError(f"autotuning.experiment_timeout = {value!r}: must be a number of seconds > 0")
        settings.experiment_timeout = float(value)
    return settings
