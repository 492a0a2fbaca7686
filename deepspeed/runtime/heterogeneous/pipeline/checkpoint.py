# SPDX-License-Identifier: Apache-2.0
"""Pipeline checkpoints that load into another cut of the layers (docs/pipeline.md#checkpoints).

Upstream's pipeline checkpoint saves each layer's weights in a file of its own, named by the
layer's global index, so weights already load into any cut. The optimizer state is saved by stage
(``mp_rank_SS_model_states.pt``, or ZeRO's ``zero_pp_rank_D_mp_rank_SS_optim_states.pt``), as
flat buffers or by parameter index: it fits only the stage that wrote it. A stage whose devices
changed speed, or a resume on another cluster, would have to keep the old cut.

So each stage also saves its layers' optimizer state by layer (``save_layer_states``), beside
upstream's files: for every trainable parameter, named as in ``PipelineModule.state_dict()``
(``"7.weight"``: the layer's global index), its fp32 master weight where the optimizer keeps one
and its state tensors (Adam's ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``), whole; and
the optimizer's step. Under ZeRO-1 and bf16, a stage's replicas hold parts of that state: they
assemble each parameter's (one all-reduce per tensor in the stage's data-parallel group) and the
first replica writes it. A manifest records the cut.

``load_checkpoint`` compares the manifest's cut with this run's. The same cut: upstream's load, as
before. Another cut of the same layers into the same number of stages: upstream loads the weights
from the layer files and the scheduler, step counts and the fork's record from its stage file
(those are the same on every stage), without its optimizer state; then every rank puts its new
layers' saved state into its optimizer (no collective). The replicas' count may differ too: the
saved state is whole, not partitioned, so the same cut on another number of replicas under ZeRO
(which upstream refuses) loads the same way.

It is done at load, not in place at a step boundary: moving a layer in place would rebuild the
stage's module, optimizer, ZeRO partitions and the pipeline engine's buffers, which is what a new
engine does. The cost is disk: the state is saved twice (for Adam, 12 bytes per parameter more;
``heterogeneous_config.pipeline.save_layer_states: false`` turns it off, and then a checkpoint only
resumes into its own cut, with a message that says so).
"""

import glob
import inspect
import os

import torch

from deepspeed import comm as dist

VERSION = 1
MANIFEST = "heterogeneous_pipeline.pt"
PREFIX = "heterogeneous_states-"


def optimizer_kind(engine):
    """How this engine's optimizer holds per-parameter state: ``("mapped", None)`` (ZeRO-1/2 and
    bf16: each parameter maps to fragments of flat fp32 partitions), ``("plain", None)`` (a torch
    optimizer over the module's parameters), or ``(None, reason)``."""
    optimizer = engine.optimizer
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    if optimizer is None:
        return None, "the engine has no optimizer"
    if trainable and all(hasattr(p, "_hp_mapping") for p in trainable) and hasattr(
            optimizer, "_lazy_init_hp_params_optimizer_state"):
        return "mapped", None
    if isinstance(optimizer, torch.optim.Optimizer):
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if all(id(p) in held for p in trainable):
            return "plain", None
    return None, (f"its optimizer {type(optimizer).__name__} keeps no per-parameter state the fork can move "
                  "(supported: a torch optimizer without ZeRO in fp32, ZeRO-1/2, bf16)")


def _owner(name, stage):
    """The file a parameter's state is saved in: its layer's (by global index), or a tied module's."""
    head = name.split(".")
    if head[0].isdigit():
        return f"layer_{int(head[0]):02d}"
    if head[0] == "tied_modules" and len(head) > 1:
        return f"tied_{head[1]}-stage_{stage:02d}"
    return f"other_{head[0]}-stage_{stage:02d}"


def _trainable(engine):
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def _cpu(value):
    return value.detach().to("cpu").clone() if torch.is_tensor(value) else value


def _latest(steps):
    """The highest of the step counts found (tensors or numbers): DeepSpeed's FusedAdam advances
    only one parameter's ``step`` per group, so the others' read 0."""
    steps = [step for step in steps if step is not None]
    if not steps:
        return None
    return max(steps, key=lambda step: float(step))


def _groups(optimizer):
    """The param groups' hyperparameters (a scheduler's lr included), without their parameters."""
    return [{key: _cpu(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _mapped_records(engine, named):
    """Per parameter, its whole fp32 master weight and state tensors; collectives in the stage's
    data-parallel group, the same on its replicas: the keys are those the fragments link (tensors
    shaped as their flat partition), after a fresh link (a load re-creates the fragments)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    optimizer = engine.optimizer
    base = optimizer.optimizer
    flats = [p for group in base.param_groups for p in group["params"]]
    keys = sorted({key for flat in flats if flat in base.state for key, value in base.state[flat].items()
                   if torch.is_tensor(value) and value.shape == flat.shape})
    if keys:
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    step = _latest(_cpu(base.state[flat].get("step")) for flat in flats if flat in base.state)
    records = {}
    for name, parameter in named:
        record = {"fp32": _cpu(safe_get_full_fp32_param(parameter))}
        for key in keys:
            record[key] = _cpu(safe_get_full_optimizer_state(parameter, key))
        records[name] = record
    return records, step


def _plain_records(engine, named):
    records = {}
    for name, parameter in named:
        state = engine.optimizer.state.get(parameter, {})
        records[name] = {"fp32": None, **{key: _cpu(value) for key, value in state.items()}}
    return records, _latest(record.get("step") for record in records.values())


def _global_state(optimizer):
    """ZeRO's loss scaler and overflow state (fp16), as its own checkpoint saves them; None for
    optimizers without one."""
    if not hasattr(optimizer, "_load_global_state") or not hasattr(optimizer, "loss_scaler"):
        return None
    from deepspeed.checkpoint.constants import CLIP_GRAD, DS_VERSION, LOSS_SCALER
    from deepspeed.git_version_info import version
    from deepspeed.runtime.fp16.adaptive_scaler import saved_loss_scaler
    return {LOSS_SCALER: saved_loss_scaler(optimizer.loss_scaler), "dynamic_loss_scale": optimizer.dynamic_loss_scale,
            "overflow": optimizer.overflow, CLIP_GRAD: optimizer.clip_grad, DS_VERSION: version}


def save_layer_states(engine, save_dir, tag):
    """The pipeline engine's ``save_checkpoint``: before upstream's files, this stage's layers'
    optimizer state by layer and (global rank 0) the manifest. Nothing without a heterogeneous
    pipeline. Every rank calls it."""
    state = engine._config.heterogeneous
    layout = state.pipeline
    if layout is None:
        return
    directory = os.path.join(save_dir, str(tag))
    checkpoint_engine = engine.checkpoint_engine
    kind, reason = optimizer_kind(engine)
    if not state.settings.config.pipeline.save_layer_states:
        kind, reason = None, "heterogeneous_config.pipeline.save_layer_states was false"
    stage, writer = engine.stage_id, engine.grid.data_parallel_id == 0
    if kind is not None:
        named = _trainable(engine)
        records, step = (_mapped_records if kind == "mapped" else _plain_records)(engine, named)
        if writer:
            checkpoint_engine.makedirs(directory, exist_ok=True)
            by_owner = {}
            for name, record in records.items():
                by_owner.setdefault(_owner(name, stage), {})[name] = record
            optimizer = engine.optimizer.optimizer if kind == "mapped" else engine.optimizer
            shared = {"version": VERSION, "kind": kind, "stage": stage, "step": step, "groups": _groups(optimizer),
                      "global_state": _global_state(engine.optimizer) if kind == "mapped" else None}
            for owner, params in by_owner.items():
                checkpoint_engine.save({**shared, "params": params}, os.path.join(directory, f"{PREFIX}{owner}.pt"))
    if dist.get_rank() == 0:
        checkpoint_engine.makedirs(directory, exist_ok=True)
        checkpoint_engine.save({"version": VERSION, "parts": [int(p) for p in layout.partition.parts],
                                "replicas": int(engine.grid.data_parallel_size), "layer_states": kind is not None,
                                "reason": reason},
                               os.path.join(directory, MANIFEST))


def _tag(load_dir, tag):
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as handle:
            return handle.read().strip()
    return None


def load_checkpoint(engine, load, load_dir, *args, **kwargs):
    """The pipeline engine's ``load_checkpoint`` (``load``: upstream's), see the module docstring."""
    layout = engine._config.heterogeneous.pipeline
    if layout is None:
        return load(load_dir, *args, **kwargs)
    bound = inspect.signature(load).bind(load_dir, *args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    if engine.load_universal_checkpoint():
        return load(**options)
    tag = _tag(load_dir, options.get("tag"))
    manifest = _agreed_manifest(engine, load_dir, tag)
    if manifest is None:
        return load(**options)  # upstream's checkpoint, or the fork's before layer states: the parts check stays
    saved, current = [int(p) for p in manifest["parts"]], [int(p) for p in layout.partition.parts]
    replicas = (manifest.get("replicas"), int(engine.grid.data_parallel_size))
    # ZeRO partitions a stage's optimizer state over its replicas: upstream refuses another count.
    regrouped = replicas[0] is not None and replicas[0] != replicas[1] and engine.zero_optimization()
    if saved == current and not regrouped:
        return load(**options)
    saved_layers, current_layers = _layers(saved), _layers(current)
    if len(saved) != len(current) or saved[-1] != current[-1]:
        raise ValueError(f"deepspeed-hetero: the checkpoint was saved by {len(saved_layers)} pipeline stage(s) of "
                         f"{saved_layers} layers ({saved[-1]} in all), and this run has {len(current_layers)} of "
                         f"{current_layers} ({current[-1]}); a checkpoint loads into another cut of the same layers "
                         f"into the same number of stages")
    wants_optimizer = options.get("load_optimizer_states", True) and not options.get("load_module_only", False)
    if wants_optimizer and not manifest["layer_states"]:
        if saved == current:
            raise ValueError(f"deepspeed-hetero: the checkpoint was saved by {replicas[0]} pipeline replica(s) under "
                             f"ZeRO, and this run has {replicas[1]}; its optimizer state was saved by stage only "
                             f"({manifest['reason']}), partitioned over the saving run's replicas")
        raise ValueError(f"deepspeed-hetero: the checkpoint was saved by pipeline stages of {saved_layers} layers, "
                         f"and this run cut {current_layers}; its optimizer state was saved by stage only "
                         f"({manifest['reason']}), so it resumes only into its own cut: set "
                         f"heterogeneous_config.pipeline.stage_layers to {saved_layers}")
    state = engine._config.heterogeneous
    state.loading_pipeline_parts = saved  # the fork's record and the module load accept the other cut
    options["load_optimizer_states"] = False
    try:
        result = load(**options)
    finally:
        state.loading_pipeline_parts = None
    if wants_optimizer:  # on every rank, also one whose stage file was missing: _agreed is a collective
        moved = _agreed(lambda: restore_layer_states(engine, os.path.join(load_dir, tag), loaded=result[0]),
                        "moving the layers' optimizer state")[0]
        if dist.get_rank() == 0:
            print(f"[deepspeed-hetero] load_checkpoint: the checkpoint's stages held {saved_layers} layers on "
                  f"{replicas[0]} replica(s), and this run's hold {current_layers} on {replicas[1]}: each stage took "
                  f"its layers' weights and optimizer state ({moved} parameters on global rank 0)", flush=True)
    return result


def _agreed_manifest(engine, load_dir, tag):
    """The manifest every rank goes by, or None (no rank finds one): each rank reads it where it
    finds it, and the ranks gather what they found. It decides whether a rank enters the move's
    collectives, so no rank may decide from its own file check: on node-local checkpoint
    directories only global rank 0's node holds the manifest (rank 0 writes it alone)."""

    def read():
        path = os.path.join(load_dir, tag, MANIFEST) if tag is not None else None
        if path is None or not os.path.isfile(path):
            return None
        return engine.checkpoint_engine.load(path, map_location="cpu")

    found = [(rank, manifest) for rank, manifest in enumerate(_agreed(read, "reading the checkpoint's manifest"))
             if manifest is not None]
    differing = [rank for rank, manifest in found if manifest != found[0][1]]
    if differing:
        raise ValueError(f"deepspeed-hetero: load_checkpoint: global ranks {differing} found another {MANIFEST} in "
                         f"{os.path.join(load_dir, str(tag))} than global rank {found[0][0]}; every rank must load "
                         "the same checkpoint")
    return found[0][1] if found else None


def _agreed(work, what):
    """Run ``work`` on every rank and return every rank's result, in global rank order; if it raised
    on any rank, every rank raises, naming the first (a rank that went on would wait for the failed
    one at its next collective). ``what`` completes "... failed on global rank R"."""
    error, result = None, None
    try:
        result = work()
    except Exception as exc:  # whatever it is, the peers must hear of it: they wait in the gather
        error = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (result, error))
    else:
        gathered = [(result, error)]
    failed = [(rank, text) for rank, (_, text) in enumerate(gathered) if text is not None]
    if failed:
        rank, text = failed[0]
        raise ValueError(f"deepspeed-hetero: load_checkpoint: {what} failed on global rank {rank}: {text}")
    return [value for value, _ in gathered]


def _layers(parts):
    return [b - a for a, b in zip(parts, parts[1:])]


def _read_records(engine, directory, named):
    stage = engine.stage_id
    owners = sorted({_owner(name, stage) for name, _ in named})
    records, steps, shared = {}, [], None
    for owner in owners:
        path = os.path.join(directory, f"{PREFIX}{owner}.pt")
        if not os.path.isfile(path) and "-stage_" in owner:  # a tied module: any stage that held it
            found = sorted(glob.glob(os.path.join(directory, f"{PREFIX}{owner.split('-stage_')[0]}-stage_*.pt")))
            path = found[0] if found else path
        if not os.path.isfile(path):
            raise ValueError(f"deepspeed-hetero: load_checkpoint: {path} is missing; the checkpoint's layer states "
                             f"are incomplete (a stage's save did not finish?)")
        saved = engine.checkpoint_engine.load(path, map_location="cpu")
        records.update(saved["params"])
        steps.append(saved.get("step"))
        shared = shared or saved
    missing = [name for name, _ in named if name not in records]
    if missing:
        raise ValueError(f"deepspeed-hetero: load_checkpoint: the checkpoint's layer states hold no state for "
                         f"{missing[:4]}{' ...' if len(missing) > 4 else ''}; was it saved from the same model?")
    return records, _latest(steps), shared or {}


def restore_layer_states(engine, directory, loaded=True):
    """Put this stage's layers' saved state into its optimizer; returns how many parameters.
    ``loaded``: upstream's load found this stage's files (else the move fails, naming them)."""
    if not loaded:
        raise ValueError(f"upstream's load found no checkpoint files for stage {engine.stage_id} in {directory}")
    named = _trainable(engine)
    kind, reason = optimizer_kind(engine)
    if kind is None:
        raise ValueError(f"deepspeed-hetero: load_checkpoint: this run's layers moved between stages, but {reason}")
    records, step, shared = _read_records(engine, directory, named)
    optimizer = engine.optimizer if kind == "plain" else engine.optimizer.optimizer
    groups = shared.get("groups") or []
    if len(groups) == len(optimizer.param_groups):  # the hyperparameters in force (a scheduler's lr)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update({key: value for key, value in saved.items() if key in group})
    if kind == "plain":
        _restore_plain(engine.optimizer, named, records, step)
    else:
        _restore_mapped(engine.optimizer, named, records, step)
        if shared.get("global_state") is not None:
            engine.optimizer._load_global_state(shared["global_state"])
    return len(named)


def _on(value, parameter):
    """A saved state tensor of the parameter's shape, on its device."""
    if torch.is_tensor(value) and value.shape == parameter.shape and value.dim() > 0:
        return value.to(device=parameter.device, dtype=value.dtype)
    return value.clone() if torch.is_tensor(value) else value


def _step_for(step, device, group):
    """The step count where torch optimizers keep it: on the CPU, or on the parameter's device for
    capturable and fused ones (as ``torch.optim.Optimizer.load_state_dict`` places it)."""
    if not torch.is_tensor(step):
        return step
    on_device = group.get("capturable") or group.get("fused")
    return step.detach().clone().to(device if on_device else "cpu")


def _restore_plain(optimizer, named, records, step):
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for name, parameter in named:
        record = dict(records[name])
        fp32 = record.pop("fp32", None)
        if fp32 is not None and parameter.dtype == torch.float32:
            with torch.no_grad():
                parameter.copy_(fp32.to(parameter.device))
        state = {key: _on(value, parameter) for key, value in record.items() if key != "step"}
        if state and step is not None:  # one count for all: FusedAdam advances one parameter's per group
            state["step"] = _step_for(step, parameter.device, group_of.get(id(parameter), {}))
        if state:
            optimizer.state[parameter] = state


def _restore_mapped(optimizer, named, records, step):
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    keys = sorted({key for record in records.values() for key, value in record.items()
                   if key not in ("fp32", "step") and torch.is_tensor(value) and value.dim() > 0})
    base = optimizer.optimizer
    if keys:  # the flat partitions' state, as the optimizer's first step would have made it
        for group in base.param_groups:
            for flat in group["params"]:
                state = base.state[flat]
                if step is not None:
                    state["step"] = _step_for(step, flat.device, group)
                for key in keys:
                    if key not in state:
                        state[key] = torch.zeros_like(flat)
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    for name, parameter in named:
        record = records[name]
        fp32 = record.get("fp32")
        if fp32 is None:
            fp32 = parameter.detach().float()
        safe_set_full_fp32_param(parameter, fp32.to(parameter.device))
        for key in keys:
            safe_set_full_optimizer_state(parameter, record[key].to(parameter.device), key)
