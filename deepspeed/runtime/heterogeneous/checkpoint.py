# SPDX-License-Identifier: Apache-2.0
"""Checkpoints of heterogeneous runs: the plan in force, the samplers' positions, the runtime's progress.

Without them a resumed run restarts the epoch from its first sample and from the start-up plan:
samples are seen twice, the profiling steps run again and the parameters drift from the run that
was never interrupted. ``engine.save_checkpoint`` calls ``save_state`` and
``engine.load_checkpoint`` calls ``load_state`` (one hook each, in upstream's engine.py).

Where it is stored: upstream's client state, i.e. the model-states file, under ``KEY``. That file
is written by data-parallel rank 0 (every rank under ZeRO-3) and read by every rank, so what it
holds must describe every rank. It does: the plan is the same everywhere, and a sampler's
position is stored without the rank (epoch, the splits by round, the rounds handed out), from
which each rank derives its own slices, also a rank of a resized group. ``save_state`` gathers
every rank's positions and refuses a checkpoint where they differ (a loader fetched ahead on some
rank) rather than write one that would resume wrongly. The only per-rank values, each rank's
steps since the last rebalancing check, are gathered into the record by global rank.

Everything is stored as plain values (dicts, lists, numbers), never a class of the fork, so a
checkpoint of a heterogeneous run still unpickles in upstream DeepSpeed, which hands the record
back as client state; with the fork off nothing is added and the checkpoint is upstream's.

On load:

- the same cluster (devices, emulation, strategy, data-parallel world size) and batch: the plan,
  the runtime controller (``HeterogeneousRuntime.state_dict``: its phase, the profiling
  measurements, the rebalancer with a switch awaiting its check and the plans it reverted, the
  events) and the samplers continue exactly where the saving run was;
- another cluster: the checkpoint's plan is kept (compute_aware; with ``manual``/``uniform`` the
  config's plan, so that changed ``micro_batch_sizes`` take effect), profiling runs again from it,
  and the samplers continue at the saved position (re-split when the plan differs);
- another world size or ``train_batch_size``: the start-up plan of this run, and the rest of the
  epoch is split with it (``sampler.load_state_dict`` re-splits); a ZeRO-1/2/3 optimizer state cut
  for another world or other shares is re-partitioned through its universal form
  (``elastic/resize.py``, before upstream's load), and one line says what changed.
"""

from deepspeed import comm as dist
from deepspeed.utils import logger

from .comm.low_communication import host_tag, load_low_communication
from .data.sampler import resume_sampler
from .elastic.resize import finish_load
from .planning.planner import Plan

KEY = "deepspeed_hetero"
"""The client-state key of the fork's record."""
VERSION = 1


def save_state(engine, client_state, tag):
    """``save_checkpoint``'s hook: ``(client_state, tag)``, the first with the fork's record added
    under ``KEY``, or both as given when the fork is off. The tag is the user's, except in the
    low-communication mode: each host writes its replica under ``<tag>/host<h>``
    (``comm/low_communication.host_tag``). Every rank calls it (one gather)."""
    if engine.heterogeneous_plan is None:
        return client_state, tag
    low = engine._config.heterogeneous.low_communication
    if KEY in client_state:
        raise KeyError(f"client_state contains the key {KEY!r}, which deepspeed-hetero uses for its own state; "
                       f"rename that entry")
    runtime = engine._heterogeneous_runtime()
    samplers = runtime.feeding.samplers  # the plan-following batch samplers, in registration order
    mine = {
        "samplers": [sampler.state_dict() for sampler in samplers],
        "mid_round": [index for index, sampler in enumerate(samplers) if sampler.mid_round],
        "window": runtime.window_state(),
    }
    everyone = runtime.agreement.gather_from_every_rank(mine, "the samplers' positions to save a checkpoint")
    check_positions_agree([entry["samplers"] for entry in everyone])
    if any(entry["mid_round"] for entry in everyone) or not _at_step_boundary(engine, runtime):
        if dist.get_rank() == 0:
            logger.warning("deepspeed-hetero: save_checkpoint in the middle of an optimizer step; DeepSpeed does not "
                           "save the gradients accumulated so far, and the resumed run starts a new step with the "
                           "next micro-batch. Save after engine.step() at an accumulation boundary to resume exactly")
    record = {
        "version": VERSION,
        "plan": engine.heterogeneous_plan.to_dict(),
        "cluster": cluster_signature(engine._config.heterogeneous),
        "runtime": runtime.state_dict(),
        "windows": [entry["window"] for entry in everyone],
        "samplers": mine["samplers"],
        "pipeline_parts": _pipeline_parts(engine._config.heterogeneous.pipeline),
    }
    if low is not None:
        record["low_communication"] = low.state_dict()
        tag = host_tag(tag, low.replicas.host)
    return {**client_state, KEY: record}, tag


def _pipeline_parts(layout):
    return None if layout is None else list(layout.partition.parts)


def load_state(engine, client_state, load_module_only=False):
    """``load_checkpoint``'s hook: restore the fork's record and return ``client_state`` without it
    (what the user gets back stays their own). Every rank calls it; no collective."""
    elastic = finish_load(engine)
    if not client_state or KEY not in client_state:
        if client_state is not None and engine.heterogeneous_plan is not None and not load_module_only:
            _log(engine, "the checkpoint holds no deepspeed-hetero state (written by upstream or with the fork "
                 "off): the start-up plan stays, and samplers start at their epoch's beginning")
        return client_state
    client_state = dict(client_state)
    record = client_state.pop(KEY)
    if engine.heterogeneous_plan is None:
        _log(engine, "the checkpoint was written with heterogeneous_config enabled; with it off here, its plan and "
             "sampler positions are ignored")
        return client_state
    if load_module_only:
        return client_state
    restore(engine, record, elastic)
    return client_state


def restore(engine, record, elastic=None):
    """Make ``engine`` continue from the fork's ``record`` (see the module docstring)."""
    version = record.get("version") if isinstance(record, dict) else None
    if version != VERSION:
        raise ValueError(f"deepspeed-hetero checkpoint record: version {version!r} is not supported (this build "
                         f"reads version {VERSION})")
    state = engine._config.heterogeneous
    runtime = engine._heterogeneous_runtime()
    saved = Plan.from_dict(record["plan"])
    current = state.plan
    if state.pipeline is not None:
        _check_pipeline_parts(engine, record.get("pipeline_parts"))
        if (saved.micro_batch_sizes, saved.gradient_accumulation_steps) != (current.micro_batch_sizes,
                                                                            current.gradient_accumulation_steps):
            # The pipeline engine fixed each replica's micro-batches as it started; the samplers
            # resume the same global batches under this run's split.
            _log(engine, f"the checkpoint's replica plan {list(saved.micro_batch_sizes)} differs from this run's "
                 f"{list(current.micro_batch_sizes)}, which stays (a pipeline keeps its start-up plan)")
        saved = current
    low = state.low_communication
    if low is not None or "low_communication" in record:
        load_low_communication(low, record.get("low_communication"))
    same_shape = (saved.world_size == current.world_size and saved.train_batch_size == current.train_batch_size
                  and (runtime.per_rank_gas_allowed or not saved.per_rank_gas))
    same_cluster = same_shape and record["cluster"] == cluster_signature(state)
    if same_shape and (same_cluster or state.settings.config.strategy.adapts):
        if (saved.micro_batch_sizes, saved.gradient_accumulation_steps) != (current.micro_batch_sizes,
                                                                            current.gradient_accumulation_steps):
            runtime.switch_to(saved, "plan restored from the checkpoint")
        else:
            state.plan = saved  # the same split; keep the saved predictions
    elif saved.world_size != current.world_size or saved.train_batch_size != current.train_batch_size:
        _log(engine, world_change_line(saved, current, elastic, record["samplers"]))
    elif elastic is not None:
        _log(engine, world_change_line(saved, current, elastic, record["samplers"]))
    windows = record.get("windows") or []
    window = windows[dist.get_rank()] if same_cluster and dist.get_rank() < len(windows) else None
    runtime.load_state_dict(record["runtime"] if same_cluster else None, window)
    if not same_cluster and runtime.profiling:
        _log(engine, "the checkpoint was written on another cluster (devices, emulation or strategy differ): "
             "profiling runs again from the plan in force")
    _restore_samplers(runtime, record["samplers"])


def world_change_line(saved, current, elastic, samplers):
    """One line of what changed between the saving run and this one, e.g. "saved on 3 ranks
    [4, 3, 1], resumed on 2 [6, 2]; ZeRO-2 optimizer state re-partitioned (shares [0.50, 0.30,
    0.20] -> equal) through the universal checkpoint <path>, converted in 3.1 s; the samplers
    continue at round 3 of epoch 0"."""
    line = (f"saved on {saved.world_size} ranks {list(saved.micro_batch_sizes)}, resumed on {current.world_size} "
            f"{list(current.micro_batch_sizes)}")
    if saved.train_batch_size != current.train_batch_size:
        line += f" (train_batch_size {saved.train_batch_size} -> {current.train_batch_size})"
    if elastic is not None:
        how = (f"converted in {elastic['seconds']:.1f} s" if elastic["converted"] else "converted by an earlier load")
        line += (f"; ZeRO-{elastic['stage']} optimizer state re-partitioned (shares "
                 f"{_shares_text(elastic['saved_shares'])} -> {_shares_text(elastic['shares'])}) through the "
                 f"universal checkpoint {elastic['path']}, {how}")
    if samplers:
        first = samplers[0]
        line += f"; the samplers continue at round {first['rounds_done']} of epoch {first['epoch']}"
    return line


def _shares_text(shares):
    return "equal" if shares is None else "[" + ", ".join(f"{s:.2f}" for s in shares) + "]"


def check_pipeline_checkpoint(engine, checkpoint):
    """The pipeline engine's module load (before its optimizer state loads): refuse a checkpoint of
    other stages with a message that says how to resume from it. Nothing when the fork is off."""
    layout = engine._config.heterogeneous.pipeline
    record = checkpoint.get(KEY) if isinstance(checkpoint, dict) else None
    if layout is not None and isinstance(record, dict):
        _check_pipeline_parts(engine, record.get("pipeline_parts"))


def _check_pipeline_parts(engine, saved_parts):
    """Upstream's pipeline checkpoint holds each stage's optimizer state for its layers: it resumes
    only into the same stages, unless the stages' layer states move (pipeline/checkpoint.py)."""
    layout = engine._config.heterogeneous.pipeline
    if saved_parts is None or list(saved_parts) == list(layout.partition.parts):
        return
    if list(saved_parts) == engine._config.heterogeneous.loading_pipeline_parts:
        return
    saved = [b - a for a, b in zip(saved_parts, saved_parts[1:])]
    raise ValueError(f"deepspeed-hetero: the checkpoint was saved by pipeline stages of {saved} layers, and this run "
                     f"cut {list(layout.partition.layers_per_stage)}; each stage's optimizer state belongs to its "
                     f"layers, so set heterogeneous_config.pipeline.stage_layers to {saved} to resume from it")


def _restore_samplers(runtime, states):
    samplers = runtime.feeding.samplers
    if not states:
        return
    if not samplers:
        # None registered yet (the Trainer registers its sampler when training begins, after it
        # loaded the checkpoint): each resumes when registered, in the saved order.
        runtime.feeding.deferred_sampler_states = list(states)
        return
    if len(samplers) != len(states):
        raise ValueError(f"deepspeed-hetero: the checkpoint holds the positions of {len(states)} heterogeneous "
                         f"sampler(s) (the engine's loader from deepspeed.initialize(training_data=...) and those of "
                         f"engine.heterogeneous_sampler / register_heterogeneous_sampler, in that order), but "
                         f"{len(samplers)} are registered now. Create the same samplers, in the same order, before "
                         f"engine.load_checkpoint(), so that each resumes where it was")
    for index, (sampler, saved) in enumerate(zip(samplers, states)):
        resume_sampler(sampler, saved, index)


def check_positions_agree(positions):
    """Raise when the ranks' sampler positions differ: the record is one description for all ranks.

    ``positions``: per global rank, the list of its samplers' ``state_dict()``."""
    counts = {len(p) for p in positions}
    if len(counts) > 1:
        raise ValueError(f"deepspeed-hetero: save_checkpoint: the ranks registered different numbers of heterogeneous "
                         f"samplers ({[len(p) for p in positions]} by global rank); every rank must create the same "
                         f"ones")
    for index in range(counts.pop() if counts else 0):
        by_rank = [p[index] for p in positions]
        if any(state != by_rank[0] for state in by_rank[1:]):
            where = ", ".join(f"rank {rank}: epoch {s['epoch']} round {s['rounds_done']}"
                              for rank, s in enumerate(by_rank))
            raise ValueError(f"deepspeed-hetero: save_checkpoint: heterogeneous sampler {index} is at different "
                             f"positions on the ranks ({where}); a checkpoint must be taken where every rank has drawn "
                             f"the same rounds (after engine.step(), with loaders that do not fetch ahead of the step)")


def cluster_signature(state):
    """What the saved measurements are measurements of: the devices (by kind, not by host or score),
    the emulation, the strategy. Equal signatures: the runtime's state carries over."""
    devices = None
    if state.devices:
        devices = [[d.name, d.accelerator, d.memory_bytes] for d in state.devices]
    settings = state.settings.config
    emulation = settings.emulation
    if emulation is not None:
        emulation = {
            "speeds": emulation.speeds,
            "memory_gb": emulation.memory_gb,
            "speed_schedule": [[change.step, change.speeds] for change in emulation.speed_schedule or []],
        }
    return {
        "devices": devices,
        "emulation": emulation,
        "strategy": settings.load_balancing_strategy,
        "micro_batch_sizes": settings.micro_batch_sizes,  # manual: the user's sizes win over the saved plan
        "world_size": state.plan.world_size if state.plan is not None else None,
    }


def _at_step_boundary(engine, runtime):
    gas = engine.gradient_accumulation_steps()
    return (engine.micro_steps - runtime.gas_origin) % gas == 0


def _log(engine, message):
    if dist.get_rank() == 0:
        print(f"[deepspeed-hetero] load_checkpoint: {message}", flush=True)
