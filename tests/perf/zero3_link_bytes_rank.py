# SPDX-License-Identifier: Apache-2.0
"""One rank of bench_zero3_link_bytes.py: ZeRO-3 configurations and single gloo collectives, between
the link-counter marks.

Started by the real ``deepspeed`` launcher on every emulated host (``scripts/emulated_cluster.py``).
``--parts`` selects what runs, in this order:

- ``zero3``: for every name in ``--configs`` (``CONFIGS``), one ZeRO-3 engine of the small GPT of
  examples/tiny_gpt (bench size, fp32, AdamW, the fork enabled with the uniform split, micro-batch
  ``--micro-batch`` per rank), trained from the same weights on the same samples::

      warm-up steps | mark <name>-a | SHORT steps | mark <name>-b | LONG steps | mark <name>-c

  During the LONG steps every collective that goes through ``deepspeed.comm`` is recorded by phase
  (forward, backward, optimizer step) with ``collective_log.recording`` (the fork's listener on the
  comm clock's call site): per phase, op and group size the calls and the bytes of the largest
  tensor argument per step (the full, gathered or unreduced, tensor of a gather or reduce-scatter).
  A backward ``all_gather_into_tensor`` is a re-gather of parameters the forward already gathered
  and released.
- ``collectives``: for every size in ``--sizes`` (fp32 elements of the full tensor) and every op in
  ``COLLECTIVES`` on the world group: one warm-up call, then
  ``mark <op>@<size>-a | SHORT calls | mark -b | LONG calls | mark -c``.

The marks are comm_train.py's (every rank at a barrier while the benchmark reads the ``tc`` byte
counters), so (c - b) - (b - a) over LONG - SHORT is the link traffic of one step or one call.
Each rank saves ``<out>/rank<R>.json``: per configuration the ZeRO-3 settings in force, the count
of persistent (never partitioned) parameters, whether the hierarchical reducer was in force, the
size of the hpZ group in force (1: none; see ``CONFIGS`` on why hpZ runs last), the collective log,
the long segment's seconds and the losses; per collective its tensor bytes.
"""

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from comm_train import LR, mark

MODES = ("flat", "hier", "shards")
"""``flat``: ``communication.hierarchical_reduction: false`` (upstream's reduce-scatter);
``hier``: ``"auto"`` (the fork's hierarchical reduction across hosts) with ``zero3_host_shards:
false`` (parameter gathers over every rank); ``shards``: both ``"auto"`` (gathers inside each host
from the host shards, ``comm/host_shards.py``)."""

REUSE0 = {"stage3_max_reuse_distance": 0}
PREFETCH0 = {"stage3_prefetch_bucket_size": 0}
REUSE0_PREFETCH0 = dict(REUSE0, **PREFETCH0)
HPZ2 = {"zero_hpz_partition_size": 2}

CONFIGS = {
    # name: (reduction mode, zero_optimization keys on top of {"stage": 3}, description). "reuse 0":
    # stage3_max_reuse_distance 0; "prefetch 0": stage3_prefetch_bucket_size 0 (no prefetching: each
    # module gathers its own parameters when it runs); hpZ=2: zero_hpz_partition_size 2 (a secondary
    # copy of the parameters partitioned inside each host, which backward gathers from).
    "flat": ("flat", {}, "flat"),
    "flat-r0": ("flat", REUSE0, "flat + reuse 0"),
    "flat-p0": ("flat", PREFETCH0, "flat + prefetch 0"),
    "flat-r0p0": ("flat", REUSE0_PREFETCH0, "flat + reuse 0 + prefetch 0"),
    "hier": ("hier", {}, "hier"),
    "hier-r0p0": ("hier", REUSE0_PREFETCH0, "hier + reuse 0 + prefetch 0"),
    "shards": ("shards", {}, "hier + host shards"),
    "shards-r0p0": ("shards", REUSE0_PREFETCH0, "hier + host shards + reuse 0 + prefetch 0"),
    "coded": ("coded", {}, "hier + host shards + lossless"),
    "coded-r0p0": ("coded", REUSE0_PREFETCH0, "hier + host shards + lossless + reuse 0 + prefetch 0"),
    "hpz2": ("flat", HPZ2, "hpZ=2"),
    "hpz2-r0p0": ("flat", dict(HPZ2, **REUSE0_PREFETCH0), "hpZ=2 + reuse 0 + prefetch 0"),
}
"""In run order: hpZ last. Upstream keeps the hpZ group in a module global
(``groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``) that ``engine.destroy()`` does not clear, and every later
ZeRO-3 engine of the process takes it whatever its ``zero_hpz_partition_size`` (``stage3.py``), so an
engine built after an hpZ one is an hpZ engine; ``train`` refuses to build one."""

COLLECTIVES = ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor")
SHORT, LONG = 1, 3
"""Calls per segment of the ``collectives`` part."""

SETTINGS = ("param_persistence_threshold", "max_reuse_distance", "prefetch_bucket_size", "max_live_parameters",
            "zero_hpz_partition_size")


def entry_bytes(entry):
    """Bytes of the largest tensor of a ``collective_log.Collective``."""

    def sizes(value):
        if len(value) == 2 and isinstance(value[1], str):  # one tensor: (shape, dtype)
            numel = 1
            for dim in value[0]:
                numel *= dim
            yield numel * torch.empty(0, dtype=getattr(torch, value[1])).element_size()
        else:
            for item in value:
                yield from sizes(item)

    return max((size for _, value in entry.tensors for size in sizes(value)), default=0)


@contextmanager
def phase(log, name):
    """Record the block's collectives into ``log`` ("phase|op|g<group size>" -> [calls, bytes]);
    ``log`` None: record nothing."""
    if log is None:
        yield
        return
    from deepspeed.runtime.heterogeneous.measure import collective_log

    with collective_log.recording() as entries:
        yield
    for entry in entries:
        tally = log[f"{name}|{entry.op}|g{len(entry.group)}"]
        tally[0] += 1
        tally[1] += entry_bytes(entry)


def train(args, out, name, rank, world_size):
    """One ZeRO-3 engine of configuration ``name`` through the marks; returns its measurements."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.comm import hierarchical, host_shards
    from deepspeed.utils import groups
    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch

    mode, zero, _ = CONFIGS[name]
    if zero.get("zero_hpz_partition_size", 1) <= 1 and groups._get_zero_param_intra_parallel_group() is not None:
        raise RuntimeError(f"{name}: an earlier hpZ engine left its group behind, which this engine would take "
                           "(see CONFIGS); run hpZ configurations last")
    model = GPT(GPTConfig.bench(), seed=0)
    global_batch = args.micro_batch * world_size
    reduction = False if mode == "flat" else "auto"
    config = {"train_batch_size": global_batch, "steps_per_print": 10**6,
              "zero_optimization": dict({"stage": 3}, **zero),
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform",
                                       "mixed_precision_support": "fp32",
                                       "communication": {"hierarchical_reduction": reduction,
                                                         "zero3_host_shards": mode in ("shards", "coded"),
                                                         "compress_inter_host": mode == "coded" and "lossless"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    zero_config = engine._config.zero_config
    steps = args.warmup + args.short + args.long
    data = TokenDataset(seq_len=model.config.seq_len, num_samples=steps * global_batch, seed=0)
    losses = []
    log = defaultdict(lambda: [0, 0])

    def step(index, record):
        start = index * global_batch + rank * args.micro_batch
        inputs, targets = split_batch(torch.stack([data[i] for i in range(start, start + args.micro_batch)]))
        with phase(record, "forward"):
            loss = engine(inputs, targets)
        with phase(record, "backward"):
            engine.backward(loss)
        with phase(record, "step"):
            engine.step()
        losses.append(loss.item())

    for index in range(args.warmup):
        step(index, None)
    mark(out, f"{name}-a")
    for index in range(args.warmup, args.warmup + args.short):
        step(index, None)
    mark(out, f"{name}-b")
    started = time.perf_counter()
    for index in range(args.warmup + args.short, steps):
        step(index, log)
    dist.barrier()  # the segment ends when the slowest rank is done
    seconds = time.perf_counter() - started
    mark(out, f"{name}-c")
    secondary = engine.optimizer.parameter_offload.zero_param_parallel_group  # hpZ's group, or None
    result = {"settings": {key: getattr(zero_config, key) for key in SETTINGS},
              "persistent_parameters": len(engine.optimizer.persistent_parameters),
              "secondary_group_size": 1 if secondary is None else dist.get_world_size(secondary),
              "hierarchical": hierarchical.reducer_for(engine.seq_data_parallel_group) is not None,
              "host_shards": host_shards.serves(list(engine.module.parameters())) is not None,
              "collectives_per_step": {key: [calls / args.long, size / args.long]
                                       for key, (calls, size) in sorted(log.items())},
              "long_steps": args.long, "seconds": seconds, "losses": losses}
    engine.destroy()
    return result


def collectives(out, sizes, world_size):
    """Each op of COLLECTIVES at each size between the marks; returns their tensor bytes."""
    from deepspeed import comm as dist

    result = {}
    for numel in sizes:
        full = torch.randn(numel)
        shard = torch.randn(numel // world_size)
        calls = {
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(numel // world_size),
                                                                        full.clone()),
            "all_reduce": lambda: dist.all_reduce(full.clone()),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(numel), shard),
        }
        for op in COLLECTIVES:
            tag = f"{op}@{numel}"
            calls[op]()  # warm-up: connections and buffers exist before mark a
            mark(out, f"{tag}-a")
            for _ in range(SHORT):
                calls[op]()
            mark(out, f"{tag}-b")
            for _ in range(LONG):
                calls[op]()
            mark(out, f"{tag}-c")
            result[tag] = {"op": op, "numel": numel, "tensor_bytes": numel * full.element_size(), "short": SHORT,
                           "long": LONG}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="zero3,collectives", help="zero3, collectives or both")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="names of CONFIGS, in order")
    parser.add_argument("--sizes", default="262144,1048576", help="fp32 elements of a collective's full tensor")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--short", type=int, default=1)
    parser.add_argument("--long", type=int, default=3)
    args = parser.parse_args()

    import deepspeed
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    parts = args.parts.split(",")
    result = {"rank": rank, "torch": torch.__version__, "backend": torch.distributed.get_backend(), "zero3": {},
              "collectives": {}}
    if "zero3" in parts:
        for name in args.configs.split(","):
            result["zero3"][name] = train(args, out, name, rank, world_size)
    if "collectives" in parts:
        result["collectives"] = collectives(out, [int(size) for size in args.sizes.split(",")], world_size)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
