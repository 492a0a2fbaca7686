# SPDX-License-Identifier: Apache-2.0
"""One rank of bench_communication.py: the small GPT trained flat and hierarchically, in turn.

Started by the real ``deepspeed`` launcher on every emulated host (``scripts/emulated_cluster.py``).
For every ZeRO stage in ``--stages`` and every repeat, it builds one engine per reduction mode
(``--modes``, default ``flat,hier``; ``flat``: ``communication.hierarchical_reduction: false``,
upstream's one flat all-reduce; ``hier``: ``"auto"``, the fork's default on several hosts, with
``overlap: "auto"`` (and ZeRO-3's ``zero3_host_shards: "auto"``); ``sync``: the same with
``overlap: false``; ``gather-all``: ``hier`` with ``zero3_host_shards: false``; ``one-chunk``: ``hier``
with each gather's host-shard refresh in one all-to-all; ``fwd-gather``: ``hier`` with ZeRO-1/2's
parameter gather during the next forward (``overlap_parameter_gather``); ``coded``: ``hier`` with
``compress_inter_host: "lossless"``; ``fwd-coded``: both; ``off``: the fork disabled,
upstream itself), alternating which mode goes first, and
trains each from the same initial weights on the same samples:

    warm-up steps | mark a | SHORT steps | mark b | LONG steps | mark c

At a mark every rank stops at a barrier and rank 0 asks the benchmark, which runs outside the
namespaces, to read every link's ``tc -s`` byte counters (a file ``mark-<name>`` in ``--out``;
the benchmark answers ``ack-<name>``). Both segments pay the same per-segment overhead (the
marks' own barriers), so (c - b) - (b - a) over LONG - SHORT is the link traffic of one training
step and nothing else; start-up traffic (rendezvous, the topology probe, group creation) lies
before mark a.

Both modes run the fork (``load_balancing_strategy: uniform``, so both split the batch evenly):
the fork's comm clock then times every collective in either mode, and the only difference left
is the reduction. Each rank saves ``<out>/rank<R>.json``: per stage, mode and repeat the seconds
of the long segment, the seconds inside collectives in it, whether the hierarchical reducer was in
force, the loss of every step, and (rank 0) the largest parameter difference between the two modes.
"""

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

LR = 3e-4
ACK_TIMEOUT_S = 120


def mark(out, name):
    """Every rank stops here while the benchmark reads the link counters (see the docstring)."""
    from deepspeed import comm as dist

    dist.barrier()
    if dist.get_rank() == 0:
        (out / f"mark-{name}").write_text(str(time.time()))
        ack = out / f"ack-{name}"
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not ack.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {ack} within {ACK_TIMEOUT_S} s: is bench_communication.py reading "
                                   "the link counters?")
            time.sleep(0.005)
    dist.barrier()


@contextlib.contextmanager
def refresh_chunks(whole):
    """``one-chunk``: each gather's host-shard refresh in one all-to-all, waited for as a whole."""
    from deepspeed.runtime.heterogeneous.comm import host_shards
    saved = host_shards.REFRESH_CHUNK_BYTES
    if whole:
        host_shards.REFRESH_CHUNK_BYTES = float("inf")
    try:
        yield
    finally:
        host_shards.REFRESH_CHUNK_BYTES = saved


def train(args, out, stage, mode, repeat, rank, world_size):
    """One engine of ``mode``; returns its measurements and its final parameters."""
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    from deepspeed.runtime.heterogeneous.comm import hierarchical
    from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch

    build_started = time.perf_counter()
    model = GPT(GPTConfig.bench(), seed=0)
    global_batch = args.micro_batch * world_size
    communication = {"hierarchical_reduction": False if mode == "flat" else "auto",
                     "overlap": False if mode == "sync" else "auto"}
    if mode == "gather-all":  # ZeRO-3 without host shards: parameter gathers over every rank
        communication["zero3_host_shards"] = False
    if mode in ("fwd-gather", "fwd-coded"):  # ZeRO-1/2: the parameter gather after the step, in the next forward
        communication["overlap_parameter_gather"] = True
    if mode in ("coded", "fwd-coded"):  # what crosses hosts coded bit for bit
        communication["compress_inter_host"] = "lossless"
    if mode == "lowcomm":
        outer = {"sync_every": args.sync_every, "pseudo_gradient_dtype": args.pseudo_dtype,
                 "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        communication = {"mode": "low_communication", "low_communication": outer}
    zero = {"stage": stage, **({"reduce_bucket_size": args.reduce_bucket} if args.reduce_bucket else {})}
    if str(stage) in args.overlap_comm_stages.split(","):
        zero["overlap_comm"] = True  # ZeRO-1 reduces during the backward (not after it) only with overlap_comm
    if mode == "hpz":  # upstream's flat reduction with ZeRO++'s secondary partition inside each host
        communication = {"hierarchical_reduction": False, "overlap": False}
        zero["zero_hpz_partition_size"] = int(os.environ.get("LOCAL_SIZE", "1"))
    config = {"train_batch_size": global_batch, "steps_per_print": 10**6, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "heterogeneous_config": {"enabled": mode != "off", "load_balancing_strategy": "uniform",
                                       "mixed_precision_support": "fp32", "communication": communication}}
    if args.dilation:  # every rank's compute stretched by sleeping: the cores stay free for communication
        config["heterogeneous_config"]["emulation"] = {"mode": "dilation", "speeds": [args.dilation] * world_size,
                                                       "dilation_clock": args.dilation_clock}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    reducer = hierarchical.reducer_for(engine.seq_data_parallel_group)
    build_seconds = time.perf_counter() - build_started
    steps = args.warmup + args.short + args.long
    data = TokenDataset(seq_len=model.config.seq_len, num_samples=steps * global_batch, seed=0)
    losses = []
    by_phase = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # exposed communication of the long segment

    def step(index, timed=False):
        start = index * global_batch + rank * args.micro_batch
        batch = torch.stack([data[i] for i in range(start, start + args.micro_batch)])
        inputs, targets = split_batch(batch)
        before = comm_clock.seconds_in_collectives()
        loss = engine(inputs, targets)
        after_forward = comm_clock.seconds_in_collectives()
        engine.backward(loss)
        after_backward = comm_clock.seconds_in_collectives()
        engine.step()
        if timed:
            by_phase["forward"] += after_forward - before
            by_phase["backward"] += after_backward - after_forward
            by_phase["step"] += comm_clock.seconds_in_collectives() - after_backward
        losses.append(loss.item())

    tag = f"zero{stage}-{mode}-r{repeat}"
    for index in range(args.warmup):
        step(index)
    mark(out, f"{tag}-a")
    for index in range(args.warmup, args.warmup + args.short):
        step(index)
    mark(out, f"{tag}-b")
    profiler = None
    if args.profile and mode != "off":  # the heterogeneous profiler's share of the same segment, to compare
        from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler
        profiler = HeterogeneousProfiler(engine)
        profiler.start_heterogeneous_profile()
    # The runtime times collectives only in phases that read the clock; a uniform run is static.
    comm_clock.enable()
    low = engine._config.heterogeneous.low_communication
    sync_started = low.sync_seconds if low is not None else 0.0
    started, comm_started = time.perf_counter(), comm_clock.seconds_in_collectives()
    for index in range(args.warmup + args.short, steps):
        step(index, timed=True)
    comm_seconds = comm_clock.seconds_in_collectives() - comm_started
    sync_seconds = low.sync_seconds - sync_started if low is not None else None
    from deepspeed import comm as dist
    dist.barrier()  # the segment ends when the slowest rank is done
    seconds = time.perf_counter() - started
    profiled = None
    if profiler is not None:
        profiler.stop_profile()
        metrics = profiler.get_metrics()
        profiled = {"communication_share": metrics["communication_share"],
                    "step_communication_share": metrics["step_communication_share"]}
    mark(out, f"{tag}-c")
    eval_loss = None
    if args.eval_samples:  # the final model (low-communication: the replicas synchronised) on held-out samples
        if mode == "lowcomm":
            engine.synchronise_replicas()
        held_out = TokenDataset(seq_len=model.config.seq_len, num_samples=args.eval_samples, seed=1)
        engine.module.eval()
        with torch.no_grad():
            inputs, targets = split_batch(torch.stack([held_out[i] for i in range(args.eval_samples)]))
            eval_loss = float(engine.module(inputs, targets))
        engine.module.train()
    engine.wait_for_parameters()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    result = {"build_seconds": build_seconds, "seconds": seconds, "comm_seconds": comm_seconds, "long_steps": args.long,
              "comm_seconds_by_phase": by_phase,
              "profiler": profiled,
              "hierarchical": reducer is not None,
              "overlapped": reducer is not None and reducer.background is not None,
              "scheme": None if reducer is None else ("sharded" if reducer.layout.even else "through host leaders"),
              "sync_seconds": sync_seconds, "losses": losses, "eval_loss": eval_loss}
    engine.destroy()
    if mode == "hpz":  # destroy() leaves the hpZ group in a module global that later ZeRO-3 engines would use
        from deepspeed.utils import groups
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    return result, params


def max_difference(left, right):
    """(largest absolute difference, largest absolute value) over two lists of tensors."""
    diff = max(float((a - b).abs().max()) for a, b in zip(left, right))
    scale = max(float(a.abs().max()) for a in left)
    return diff, scale


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--modes", default="flat,hier",
                        help="flat, hier (overlap \"auto\"), sync (hier with overlap false), off (the fork "
                             "disabled: upstream itself; its collectives are timed only after a fork engine was "
                             "built in the process), lowcomm (communication.mode \"low_communication\"), hpz (ZeRO-3 only, "
                             "run last: flat with zero_hpz_partition_size the ranks per host), fwd-gather (ZeRO-1/2: hier with "
                             "overlap_parameter_gather true), coded (hier with compress_inter_host \"lossless\")")
    parser.add_argument("--sync-every", type=int, default=50, help="lowcomm: low_communication.sync_every")
    parser.add_argument("--pseudo-dtype", default="bf16", help="lowcomm: low_communication.pseudo_gradient_dtype")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="lowcomm: low_communication.outer_lr")
    parser.add_argument("--outer-momentum", type=float, default=0.5, help="lowcomm: low_communication.outer_momentum")
    parser.add_argument("--eval-samples", type=int, default=0,
                        help="evaluate the final model on this many held-out samples (0: no evaluation)")
    parser.add_argument("--profile", action="store_true",
                        help="also run the heterogeneous profiler over the measured segment")
    parser.add_argument("--overlap-comm-stages", default="",
                        help="ZeRO stages run with zero_optimization.overlap_comm true, e.g. 1")
    parser.add_argument("--reduce-bucket", type=int, default=0,
                        help="zero_optimization.reduce_bucket_size (0: the fork's link-aware size)")
    parser.add_argument("--dilation", type=float, default=0.0,
                        help="emulate every rank at this speed by time dilation (0: none)")
    parser.add_argument("--dilation-clock", choices=("own", "elapsed"), default="own",
                        help="emulation.dilation_clock: stretch each rank's own compute (default) or its elapsed time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--long", type=int, default=8)
    args = parser.parse_args()

    imported = time.time()
    import deepspeed
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    initialised = time.time()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    result = {"rank": rank, "cross_rank": os.environ.get("CROSS_RANK"), "runs": {},
              "times": {"main": imported, "initialised": initialised}}
    for stage in map(int, args.stages.split(",")):
        for repeat in range(args.repeats):
            modes = args.modes.split(",")
            modes = modes if repeat % 2 == 0 else modes[::-1]  # alternate: no order bias
            # hpZ is ZeRO-3's, and last in its repeat (``train`` clears the hpZ group it leaves).
            modes = [m for m in modes if m != "hpz" and (m not in ("gather-all", "one-chunk") or stage == 3)
                     and (m not in ("fwd-gather", "fwd-coded") or stage != 3)] + (
                ["hpz"] if "hpz" in modes and stage == 3 else [])
            params = {}
            for mode in modes:
                with refresh_chunks(whole=mode == "one-chunk"):
                    run, params[mode] = train(args, out, stage, mode, repeat, rank, world_size)
                result["runs"][f"zero{stage}-{mode}-r{repeat}"] = run
            if "flat" in params and "hier" in params:
                diff, scale = max_difference(params["flat"], params["hier"])
                result["runs"][f"zero{stage}-hier-r{repeat}"].update(max_param_diff=diff, max_param=scale)
            if "sync" in params and "hier" in params:
                result["runs"][f"zero{stage}-hier-r{repeat}"].update(
                    bitwise_vs_sync=all(torch.equal(a, b) for a, b in zip(params["sync"], params["hier"])))
            for exact in ("fwd-gather", "coded", "fwd-coded"):
                if exact in params and "sync" in params:
                    result["runs"][f"zero{stage}-{exact}-r{repeat}"].update(
                        bitwise_vs_sync=all(torch.equal(a, b) for a, b in zip(params["sync"], params[exact])))
            if "one-chunk" in params and "hier" in params:
                result["runs"][f"zero{stage}-hier-r{repeat}"].update(
                    bitwise_vs_one_chunk=all(torch.equal(a, b) for a, b in zip(params["one-chunk"], params["hier"])))
    result["times"]["done"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
