# SPDX-License-Identifier: Apache-2.0
"""Load a ZeRO checkpoint onto another world: re-partition the optimizer state by itself.

A ZeRO-1/2/3 checkpoint holds one file of optimizer state per data-parallel rank, cut as the
saving run cut it. Upstream loads it only onto the same number of ranks (and the fork's uneven
memory shares only onto the same shares); anything else must go through upstream's universal
checkpoint: ``ds_to_universal`` merges every parameter's fp32 master copy and Adam moments, and a
load with ``checkpoint.load_universal`` slices them for the ranks present, whatever their number
and shares. Adam is element-wise, so each element's next update is the same whichever rank owns
it: the resumed run is the uninterrupted one up to fp32 summation order.

``prepare_load`` (called by ``engine.load_checkpoint`` once the tag is known, one line in
``engine-heterogeneous-checkpoint.patch``) does that for the user:

1. every rank reads the saved facts from data-parallel rank 0's files (the world size, the memory
   shares) and compares them with its optimizer; the verdicts are gathered, so every rank takes
   the same branch (a rank that cannot read the folder makes every rank raise the same error);
2. on a mismatch, global rank 0 converts the tag once (a subprocess running
   ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` into ``<tag>.universal``
   beside the tag, renamed into place when complete, so a later load reuses it), and every rank
   checks that it sees the result (the folder must be shared);
3. the load then goes on as upstream's universal load of that folder; ``load_state`` turns the
   universal flag back to the user's value and ``restore`` prints one line of what changed.

Not carried by the universal path, hence refused by name when the world or shares differ:
pipeline engines, MoE layers, NVMe optimizer offload, tensor/model parallelism.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from ..comm.low_communication import replica_folder
from ..memory.partitions import PartitionLayoutError, check_checkpoint_layout, saved_bounds
from ..memory.zero3_shards import CHECKPOINT_SHARES_KEY, ShardLayoutError, check_checkpoint_shares
from .integrity import CheckpointFileError, check_tag, damaged_files, damaged_message, tag_files

UNIVERSAL_SUFFIX = ".universal"
"""The universal form of tag T is the folder ``<load_dir>/T.universal`` (or ``<conversion_dir>/T``):
beside the tag, not inside it, since upstream's converter reads a tag's folder recursively."""
DONE_FILE = "deepspeed_hetero_conversion.json"
"""Written into the universal folder last: what was converted, and in how many seconds."""


class ElasticLoadError(RuntimeError):
    """A checkpoint that cannot be loaded onto this world; raised alike on every rank."""


def prepare_load(engine, load_dir, tag, load_optimizer_states=True, load_module_only=False):
    """``(load_dir, tag)`` for upstream's load: unchanged, or the tag's universal form when its
    optimizer state was cut for another world or other shares. Every rank calls it, with the same
    arguments; it runs collectives only when the fork and ZeRO are on."""
    state = engine._config.heterogeneous
    if state.user_load_universal is None:
        state.user_load_universal = bool(engine._config.load_universal_checkpoint)
    engine._config.load_universal_checkpoint = state.user_load_universal  # a failed load may have left it set
    state.elastic_load = None
    if state.low_communication is not None:  # each host loads its own replica, on the same hosts
        tag = replica_folder(state.low_communication, load_dir, tag, load_module_only)
    if engine.heterogeneous_plan is not None and tag is not None and not state.user_load_universal:
        check_tag(engine, engine._heterogeneous_runtime().agreement, load_dir, tag, load_optimizer_states,
                  load_module_only)  # before upstream reads a file: a damaged one is named, on every rank
    if state.low_communication is not None:
        return load_dir, tag
    if (engine.heterogeneous_plan is None or not engine.zero_optimization() or state.user_load_universal
            or load_module_only or not load_optimizer_states or tag is None):
        return load_dir, tag
    if not state.settings.config.elastic.repartition:
        return load_dir, tag
    folder = os.path.join(load_dir, str(tag))
    runtime = engine._heterogeneous_runtime()
    buffers = {}
    try:
        facts, buffers = saved_facts(engine, folder)
        mine = {"facts": facts}
    except Exception as exc:  # every rank learns of it below
        mine = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = runtime.agreement.gather_from_every_rank(mine, "whether the checkpoint must be re-partitioned")
    errors = [(rank, entry["error"]) for rank, entry in enumerate(everyone) if "error" in entry]
    if errors:
        where = "; ".join(f"global rank {rank}: {error}" for rank, error in errors)
        raise ElasticLoadError(f"deepspeed-hetero: load_checkpoint could not read the checkpoint {folder} ({where})")
    facts = [entry["facts"] for entry in everyone]
    if not any(f["mismatch"] for f in facts):
        return load_dir, tag
    _refuse_unsupported(engine, facts[0])
    target = universal_folder(state.settings.config.elastic.conversion_dir, load_dir, tag)
    outcome = None
    # The conversion may take minutes: the other ranks wait for its outcome in the rendezvous store,
    # not in a collective, which the process group's timeout would end.
    key = _conversion_key(target)
    if dist.get_rank() == 0:
        try:
            outcome = convert(folder, target, saved_world=facts[0]["saved_world"])
        except CheckpointFileError as exc:
            outcome = {"damaged": str(exc)}
        except Exception as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome = wait_for_rank0(key, outcome, f"global rank 0's conversion of {folder} to a universal checkpoint")
    if "damaged" in outcome:
        raise CheckpointFileError(outcome["damaged"])
    if "error" in outcome:
        raise ElasticLoadError(f"deepspeed-hetero: load_checkpoint: converting {folder} to a universal checkpoint "
                               f"(to re-partition its optimizer state for this world) failed: {outcome['error']}")
    seen = runtime.agreement.gather_from_every_rank(os.path.isfile(os.path.join(target, DONE_FILE)),
                                                    "whether every rank sees the converted checkpoint")
    if not all(seen):
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        raise ElasticLoadError(f"deepspeed-hetero: load_checkpoint: global rank(s) {blind} do not see {target}, which "
                               f"global rank 0 wrote: the checkpoint folder (or heterogeneous_config.elastic."
                               f"conversion_dir) must be one folder shared by every rank")
    engine._config.load_universal_checkpoint = True
    state.elastic_load = {
        "saved_world": facts[0]["saved_world"],
        "saved_shares": facts[0]["saved_shares"],
        "shares": facts[0]["shares"],
        "stage": engine.zero_optimization_stage(),
        "path": target,
        "seconds": outcome.get("seconds"),
        "converted": outcome.get("converted", False),
        "buffers": buffers,  # this rank's own read: buffers are not partitioned
    }
    return os.path.dirname(target), os.path.basename(target)


def finish_load(engine):
    """After the load (``checkpoint.load_state``): the user's universal flag again, and the module's
    buffers, which a universal load leaves as they were (it restores parameters only). Returns
    what ``prepare_load`` recorded, or None."""
    state = engine._config.heterogeneous
    record = getattr(state, "elastic_load", None)
    if state.user_load_universal is not None:
        engine._config.load_universal_checkpoint = state.user_load_universal
    if record is None:
        return None
    buffers = dict(engine.module.named_buffers())
    with torch.no_grad():
        for name, value in record.pop("buffers").items():
            if name in buffers:
                buffers[name].copy_(value.to(buffers[name].device, buffers[name].dtype))
    state.elastic_load = None
    return record


def universal_folder(conversion_dir, load_dir, tag):
    if conversion_dir:
        return os.path.join(conversion_dir, str(tag))
    return os.path.join(load_dir, f"{tag}{UNIVERSAL_SUFFIX}")


def saved_facts(engine, folder):
    """What this rank needs to know of the checkpoint in ``folder``: its data-parallel world and
    shares against this optimizer's (``mismatch``; the facts every rank gathers), and the module's
    saved buffers when they will be needed (kept by this rank). Reads data-parallel rank 0's files,
    memory-mapped."""
    model_file = engine._get_ckpt_name(os.path.dirname(folder), os.path.basename(folder), pp_placeholder="0")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"{model_file} does not exist")
    model_state = _load(model_file)
    saved_world = int(model_state["dp_world_size"])
    names = glob.glob(os.path.join(folder, f"*zero_pp_rank_0_mp_rank_{engine.checkpoint_mp_rank:02d}_optim_states.pt"))
    if not names:
        raise FileNotFoundError(f"{folder} holds no ZeRO optimizer file of data-parallel rank 0")
    optimizer_state = _load(sorted(names)[0])["optimizer_state_dict"]
    world = engine.seq_dp_world_size
    mismatch = saved_world != world
    if not mismatch:
        mismatch = not _layout_matches(engine.optimizer, optimizer_state, world)
    module = model_state.get("module") or {}
    buffer_names = {name for name, _ in engine.module.named_buffers()}
    buffers = {name: value.clone() for name, value in module.items() if name in buffer_names} if mismatch else {}
    facts = {
        "saved_world": saved_world,
        "mismatch": bool(mismatch),
        "saved_shares": _saved_shares(optimizer_state),
        "shares": _current_shares(engine.optimizer, world),
        "state_keys": _state_keys(optimizer_state),
    }
    return facts, buffers


CONVERTED_STATE = ("exp_avg", "exp_avg_sq")
"""The optimizer state upstream's converter (``ds_to_universal``) merges and a universal load slices: Adam's
and AdamW's moments. Other optimizers' state (SGD's momentum buffer, Lion's exp_avg alone, Adagrad's sum) or
none at all fail inside the converter."""


def _state_keys(optimizer_state):
    """The tensors the saved optimizer keeps per parameter (one entry's keys), or [] where it keeps none."""
    # ZeRO-1/2 keep the base optimizer's state dict under base_optimizer_state, ZeRO-3 under optimizer_state_dict.
    inner = optimizer_state.get("base_optimizer_state", optimizer_state.get("optimizer_state_dict", {}))
    state = inner.get("state", {}) if isinstance(inner, dict) else {}
    for entry in state.values():
        if isinstance(entry, dict):
            return sorted(key for key, value in entry.items() if torch.is_tensor(value) and value.dim() > 0)
    return []


def _load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # a file in torch's legacy format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=False)


def _layout_matches(optimizer, optimizer_state, world):
    """Whether this optimizer's slices are the saved ones (same world). An optimizer of another kind
    than the fork's ZeRO-1/2/3 ones keeps upstream's equal slices: left to upstream's load."""
    try:
        if hasattr(optimizer, "zero3_shares"):
            check_checkpoint_shares(optimizer_state, optimizer.zero3_shares)
        elif hasattr(optimizer, "partition_layout"):
            check_checkpoint_layout(optimizer_state, optimizer.partition_layout,
                                    [flat.numel() for flat in optimizer.bit16_groups_flat], world)
    except (PartitionLayoutError, ShardLayoutError):
        return False
    return True


def _saved_shares(optimizer_state):
    shares = optimizer_state.get(CHECKPOINT_SHARES_KEY)
    if shares is not None:
        return [float(s) for s in shares]
    bounds = saved_bounds(optimizer_state)
    return None if bounds is None else _shares_of(bounds)


def _current_shares(optimizer, world):
    if hasattr(optimizer, "zero3_shares"):
        return None if optimizer.zero3_shares is None else [float(s) for s in optimizer.zero3_shares]
    layout = getattr(optimizer, "partition_layout", None)
    return None if layout is None else _shares_of(layout.groups)


def _shares_of(bounds_per_group):
    bounds = max(bounds_per_group, key=lambda b: sum(n for _, n in b))
    total = sum(n for _, n in bounds) or 1
    return [n / total for _, n in bounds]


def _refuse_unsupported(engine, facts):
    what = None
    if engine.pipeline_parallelism:
        what = "a pipeline engine's (its stages' checkpoints load into the same data-parallel world only)"
    elif engine.has_moe_layers:
        what = "a model with MoE layers"
    elif engine.zero_nvme_offload_optimizer():
        what = "an optimizer offloaded to NVMe (its swap files are per rank)"
    elif engine.mp_world_size > 1:
        what = "a model- or tensor-parallel run"
    elif not set(CONVERTED_STATE) <= set(facts.get("state_keys") or ()):
        kept = facts.get("state_keys") or []
        what = (f"the optimizer {type(engine.basic_optimizer).__name__} (its saved state per parameter is "
                f"{kept or 'empty'}; the universal checkpoint carries Adam's and AdamW's {list(CONVERTED_STATE)} only)")
    if what is not None:
        raise ElasticLoadError(
            f"deepspeed-hetero: load_checkpoint: the checkpoint's ZeRO optimizer state was cut for "
            f"{facts['saved_world']} data-parallel ranks (shares {_describe(facts['saved_shares'])}), this run has "
            f"{engine.seq_dp_world_size} (shares {_describe(facts['shares'])}); re-partitioning it is not supported for "
            f"{what}. Resume on the world and heterogeneous_memory.zero_partitions it was saved with")


def _describe(shares):
    return "equal" if shares is None else "[" + ", ".join(f"{s:.2f}" for s in shares) + "]"


def convert(folder, target, saved_world):
    """Write the universal form of the tag in ``folder`` to ``target`` unless it is there already.
    Runs upstream's converter as a subprocess (this process holds the process group's threads and
    perhaps a device context; the child returns its memory when it ends)."""
    remove_abandoned_work(target)
    source = source_listing(folder)
    done = os.path.join(target, DONE_FILE)
    if os.path.isfile(done):
        if conversion_source(done) == source:
            return {"converted": False, "seconds": None}
        # The tag was saved again since (a rerun into the same folder, a rollback, a reused name).
        logger.warning(f"deepspeed-hetero: {target} was converted from other files than {folder} holds now; "
                       "converting it again")
        shutil.rmtree(target)
    if os.path.exists(target):  # not written by this module (its folders appear complete or not at all)
        raise FileExistsError(f"{target} exists and is not a conversion of deepspeed-hetero (it has no {DONE_FILE}); "
                              f"move it away, or set heterogeneous_config.elastic.conversion_dir")
    damaged = damaged_files(tag_files(folder))  # the converter reads every file, also of ranks gone
    if damaged:
        raise CheckpointFileError(damaged_message(folder, damaged))
    began = time.perf_counter()
    work = f"{target}{PARTIAL_INFIX}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    output = os.path.join(work, "universal")
    workers = max(1, min(4, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", folder,
               "--output_folder", output, "--inject_missing_state", "--num_extract_workers", str(workers),
               "--num_merge_workers", str(workers)]
    log = os.path.join(work, "convert.log")
    try:
        with open(log, "w") as stream:
            done = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=work)
        if done.returncode != 0:
            with open(log) as stream:
                tail = "".join(stream.readlines()[-15:])
            raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{tail}")
        seconds = time.perf_counter() - began
        with open(os.path.join(output, DONE_FILE), "w") as stream:
            json.dump({"source": os.path.abspath(folder), "files": source, "saved_world": saved_world,
                       "seconds": seconds}, stream)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        os.replace(output, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"converted": True, "seconds": seconds}


PARTIAL_INFIX = ".partial-"


def source_listing(folder):
    """What a conversion is made from: every file under the tag's ``folder`` with its size and
    modification time (ns), sorted; a tag saved again differs in one of them."""
    listing = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            info = os.stat(path)
            listing.append([os.path.relpath(path, folder), int(info.st_size), int(info.st_mtime_ns)])
    return sorted(listing)


def conversion_source(done_file):
    """The source listing a conversion recorded (None for one written before it recorded it)."""
    try:
        with open(done_file) as stream:
            return json.load(stream).get("files")
    except (OSError, ValueError):
        return None


def remove_abandoned_work(target):
    """Remove the work folders of conversions into ``target`` whose process is gone (killed before it
    renamed its result into place)."""
    for work in glob.glob(glob.escape(target) + PARTIAL_INFIX + "*"):
        pid = work.rsplit(PARTIAL_INFIX, 1)[1]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(work, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_conversions = 0
"""Conversions this process has waited for: every rank converts alike, so the count is the same on every
rank, and a key is never one an earlier load (of another engine in the same job) set."""


def _conversion_key(target):
    """A store key for this load's conversion outcome, the same on every rank and new for each load."""
    global _conversions
    _conversions += 1
    return f"deepspeed-hetero/elastic-conversion/{_conversions}/{os.path.abspath(target)}"


CONVERSION_POLL_S = 0.5
CONVERSION_LOG_EVERY_S = 60.0


def wait_for_rank0(key, outcome, what):
    """Global rank 0's ``outcome`` (a JSON-able dict it passes; the others pass None) on every rank,
    through the process group's rendezvous store: the others poll it without a time limit of their
    own (a launcher ends them if rank 0 dies), logging every minute that they wait. Without a store
    (a process group of another kind), a broadcast."""
    try:
        from torch.distributed import distributed_c10d
        store = distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        store = None
    if store is None:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    if dist.get_rank() == 0:
        store.set(key, json.dumps(outcome))
        return outcome
    began = last_log = time.monotonic()
    while not store.check([key]):
        time.sleep(CONVERSION_POLL_S)
        if time.monotonic() - last_log >= CONVERSION_LOG_EVERY_S:
            last_log = time.monotonic()
            if dist.get_rank() == 1:
                logger.info(f"deepspeed-hetero: still waiting for {what} ({last_log - began:.0f} s)")
    return json.loads(store.get(key))
