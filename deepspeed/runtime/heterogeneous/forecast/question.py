# SPDX-License-Identifier: Apache-2.0
"""The question ``deepspeed plan`` answers, settled from the cluster file, ``--model``,
``--config`` and their defaults: which model, which precision, which batch, which ZeRO stages to
try, and the ds_config every prediction reads (``base_ds_config``).

Where the ds_config and the cluster file's ``training`` both set a value, the ``training`` block
wins: it is the question asked of this cluster. What was assumed rather than given is listed in
``Question.assumptions`` and printed with the plan.
"""

import copy
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..config.errors import invalid_json_message
from ..measure.devices import spec_score
from .model_description import ModelDescription, describe_model

EFFICIENCY_PRIOR = 0.4
"""Fraction of a device's datasheet peak a training step achieves (model FLOPs utilisation): a
prior until measured; large-model training on A100/H100 is typically reported at 0.3-0.5."""
DEFAULT_SAMPLES_PER_RANK = 4
DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4}}


@dataclass(frozen=True)
class Question:
    model: ModelDescription
    precision: str
    train_batch_size: int
    gas: Optional[int]
    """Given gas (None: each side picks the fewest micro-steps that fit)."""
    seq_len: int
    efficiency: float
    stages: Tuple[int, ...]
    """ZeRO stages to try (one when given)."""
    checkpointing: bool
    utilization: float
    ds_config: dict
    assumptions: List[str] = field(default_factory=list)

    @property
    def value_bytes(self):
        return 4 if self.precision == "fp32" else 2


def settle_question(cluster, model=None, ds_config=None, training=None):
    """A ``Question`` from a ``ClusterDescription`` and the overrides (``model``: anything
    ``describe_model`` takes, or a ``ModelDescription``; ``ds_config``: a dict; ``training``: keys
    of the cluster file's ``training`` block)."""
    train = dict(cluster.training or {})
    train.update(training or {})
    ds = copy.deepcopy(ds_config if ds_config is not None else _file_ds_config(cluster))
    notes = []
    spec = model if model is not None else cluster.model
    if spec is None:
        raise ValueError("no model: name one in the cluster file ('model') or with --model (a Hugging Face config "
                         "JSON, tiny_gpt, or numbers)")
    description = spec if isinstance(spec, ModelDescription) else describe_model(spec, cluster.base_dir)
    precision = train.get("precision") or _ds_precision(ds) or _best_precision(cluster)
    if "precision" not in train and _ds_precision(ds) is None:
        notes.append(f"precision {precision}: the best every device runs (not given)")
    batch = train.get("train_batch_size") or ds.get("train_batch_size")
    if not batch:
        batch = DEFAULT_SAMPLES_PER_RANK * cluster.world_size
        notes.append(f"train_batch_size {batch}: {DEFAULT_SAMPLES_PER_RANK} samples per rank (not given)")
    gas = train.get("gradient_accumulation_steps") or ds.get("gradient_accumulation_steps")
    seq_len = int(train.get("seq_len") or description.seq_len or 1)
    if "seq_len" not in train and description.seq_len:
        notes.append(f"seq_len {seq_len}: the model's longest (not given)")
    stage = train.get("zero_stage", ds.get("zero_optimization", {}).get("stage", "auto"))
    efficiency = float(train.get("efficiency", EFFICIENCY_PRIOR))
    if "efficiency" not in train:
        notes.append(f"efficiency {efficiency}: the fraction of datasheet peak a step achieves (a prior)")
    checkpointing = bool(train.get("activation_checkpointing", False))
    utilization = float(train.get("hbm_utilization_threshold",
                                  ds.get("heterogeneous_memory", {}).get("hbm_utilization_threshold", 0.85)))
    base = base_ds_config(ds, precision, int(batch), train.get("optimizer"))
    return Question(model=description, precision=precision, train_batch_size=int(batch),
                    gas=None if gas is None else int(gas), seq_len=seq_len, efficiency=efficiency,
                    stages=(0, 1, 2, 3) if stage == "auto" else (int(stage), ), checkpointing=checkpointing,
                    utilization=utilization, ds_config=base, assumptions=notes)


def base_ds_config(ds, precision, batch, optimizer=None):
    """The ds_config the predictions read: the user's, with the question's precision and batch, an
    optimizer (``optimizer`` names a type; default AdamW) and a ZeRO block."""
    ds = copy.deepcopy(ds)
    ds["train_batch_size"] = batch
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        ds.pop(key, None)
    for key in ("fp16", "bf16"):
        if key != precision:
            ds.pop(key, None)
    if precision in ("fp16", "bf16"):
        ds[precision] = {**ds.get(precision, {}), "enabled": True}
    if optimizer is not None:
        ds["optimizer"] = {"type": str(optimizer), "params": dict(DEFAULT_OPTIMIZER["params"])}
    ds.setdefault("optimizer", copy.deepcopy(DEFAULT_OPTIMIZER))
    ds.setdefault("zero_optimization", {})
    return ds


def with_stage(ds, stage, gas):
    ds = copy.deepcopy(ds)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": int(stage)}
    ds["gradient_accumulation_steps"] = int(gas)
    return ds


def peak_flops(spec, precision):
    """The rank's datasheet peak in FLOP/s for ``precision`` (falling back as training would)."""
    return spec_score(spec, precision) * 1e12


def _ds_precision(ds):
    for key in ("bf16", "fp16"):
        if ds.get(key, {}).get("enabled"):
            return key
    return None


def _best_precision(cluster):
    specs = [r.spec for r in cluster.ranks]
    if all(s.bf16_tflops > 0 for s in specs):
        return "bf16"
    if all(s.fp16_tflops > 0 for s in specs):
        return "fp16"
    return "fp32"


def _file_ds_config(cluster):
    value = cluster.ds_config
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    path = value if os.path.isabs(value) else os.path.join(cluster.base_dir, value)
    try:
        with open(path) as handle:
            return json.load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read ds_config {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(invalid_json_message(path, exc)) from None
