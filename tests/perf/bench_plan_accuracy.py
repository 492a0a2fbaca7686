# SPDX-License-Identifier: Apache-2.0
"""How well ``deepspeed plan`` predicts the runs it plans: step time, per-rank peak memory and the
bytes over the slow link, predicted for clusters this machine emulates and then measured there.

The plan must be judged on what it models, not on a datasheet prior for a CPU core, so the device
kind is given by numbers (``"cpu": true``: host memory, gloo) measured here just before each row,
and the link by a timed transfer over the emulated link:

- compute: the model's forward+backward, seconds per sample of the thread's own CPU time
  (``time.thread_time``), median of several timings, one torch thread, in as many processes at once
  as the machine has cores (the ranks keep every core busy), with the fork's host allocator setting
  (``memory/meter.py`` fixes glibc's mmap threshold on CPU ranks, so that every large tensor is
  mapped afresh: measured 11% more CPU time alone and 36% with both cores busy for this GPT, so a
  calibration without it would not be the device the ranks run on); the kind's ``fp32_tflops`` is
  the model's FLOPs per sample (the plan's own count) over it, times the rank's emulated speed, and
  the question's ``efficiency`` is 1 (the rate is already an achieved one);
- optimizer step: torch's Adam (what the ds_config names) stepping one flat fp32 tensor, as ZeRO
  steps its flat partition, alike; the kind's ``memory_bandwidth_gb_s`` is the bytes the plan
  counts for that step (``cluster_plan.optimizer_seconds``: 32 per fp32 Adam element) over the
  seconds it took;
- the pipeline's blocks, whose activations are not a decoder's (the plan's estimate from a shape
  is a decoder's): their activation bytes per sample, what autograd saves (each storage once), given
  as the model's ``activation_bytes_per_sample``; the GPT's activations are the plan's estimate;
- link: ``EmulatedCluster.measure_rate`` (payload bits/s of a TCP transfer between two hosts), one
  transfer each way at once as a ring collective loads the link (``measure_link``; 5-15% under one
  transfer alone), as the inter-host link's ``gbit_per_s``; its ``latency_us`` is a prior (the
  kernel has no netem: no delay is added).

Everything else is the plan's own: the micro-batches it chooses, the ZeRO shares, the memory model,
the activation estimate from the model's shape, the communication model. The report marks the
measured numbers ``measured``.

Emulated clusters (``scripts/emulated_cluster.py``: one network namespace per host on a bridge,
each host's link ``tbf``-shaped to ``RATE_MBIT``, every host started by the real ``deepspeed``
launcher): 2 hosts of 1 rank each (ZeRO-1, ZeRO-2, ZeRO-3, a 2-stage pipeline) and 2 hosts of 2 ranks
(ZeRO-2). Speeds by time dilation with the ``own`` clock on every rank (a rank's own compute,
its waits for a core absorbed into the sleep): the 2-rank rows at [0.4, 0.2] of a core (rank 1 half
as fast as rank 0), the 4-rank row at 0.25 each, so that the emulated devices leave the 2 cores
free and the other sessions on this machine move the measurement as little as they can.
Memory: each rank joins a memory cgroup of its own limited to its capacity in the cluster
description, after the interpreter, torch and the process group are up and before the model is
built (``plan_accuracy_rank.py``); its peak is the measured peak memory of the rank: what an empty
device would hold (the plan starts from an empty device: no baseline).

Each run executes what was predicted: the plan's micro-batches as a ``manual`` strategy, its ZeRO
shares as ``zero_partitions``, its stage and gradient accumulation (the pipeline: ``plan_pipeline``'s
cut as ``pipeline.stage_layers``), no profiling steps and no rebalancing. The fork's multi-host
communication (hierarchical reduction, overlap, host shards, link-aware buckets) is off in every
row: the plan's communication model is the flat ring (docs/planning.md, "Limits").

Measured per row: step time, the median of the timed steps on rank 0 (after the warm-up steps), and
per rank and phase where the time went (wall, inside collectives, slept by dilation, own CPU, waits
for a core: the JSON's ``phase_seconds``);
per rank the memory cgroup's peak, and per phase (v1 lets the peak be reset at each phase's end);
bytes per step over the slow link, each direction, from the
``tc -s`` counters of the last host's link read at three marks around a short and a long segment
((c - b) - (b - a) over the step difference: start-up and the marks' own traffic cancel), less the
frame headers (66 bytes a packet: Ethernet 14, IPv4 20, TCP with timestamps 32), which the plan's
payload bytes do not count. Signed relative errors (predicted - measured) / measured; the row's
``memory_error`` is its worst rank's (the most under-predicted, else the largest).

Goals (reported, not asserted): step time median |error| <= 10%, worst <= 20%; memory
within 10% and never more than 5% under; bytes within 5%. Results: tests/perf/results/plan_accuracy.json,
rendered into docs/benchmarks.md and docs/planning.md by ``scripts/render_benchmarks.py``.

    python tests/perf/bench_plan_accuracy.py                 # every row (about 9 min on 2 cores)
    python tests/perf/bench_plan_accuracy.py --rows zero1    # some rows
Needs root, ``ip`` and ``tc`` (network namespaces) and the cgroup memory controller.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "scripts"), str(REPO / "tests" / "perf")]

RANK_SCRIPT = REPO / "tests" / "perf" / "plan_accuracy_rank.py"
RESULTS = REPO / "tests" / "perf" / "results" / "plan_accuracy.json"
RATE_MBIT = 200
LATENCY_US = 50.0
"""The links' latency in the cluster description: a prior (veth and bridge, no netem delay)."""
INTRA_HOST_GBIT = 4.0
"""Ranks of one emulated host talk over loopback: gloo moves 3-6 Gbit/s there on 2 cores (a prior;
no row's ring runs at it)."""
FRAME_HEADER_BYTES = 14 + 20 + 32
GOALS = {"step_median": 0.10, "step_worst": 0.20, "memory_within": 0.10, "memory_under": 0.05, "bytes_within": 0.05}
GPT = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
PIPELINE_MICRO_BATCH = 64
CALIBRATION_PROCESSES = 2
"""As many as this machine has cores: the ranks of every row keep both busy."""
OPTIMIZER = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    ranks_per_host: Tuple[int, ...]
    speeds: Tuple[float, ...]
    """Emulated speed of each rank, in cores (dilation, ``own`` clock)."""
    memory_gb: Tuple[float, ...]
    """Each rank's capacity in the cluster description, and its memory cgroup's limit."""
    train_batch_size: int
    gas: int
    stage: Optional[int] = None
    """ZeRO stage (None: the pipeline)."""
    steps: Tuple[int, int, int] = (2, 2, 8)
    """(warm-up, short, long) steps."""
    extra: dict = field(default_factory=dict)


ROWS = {
    "zero1": Row("zero1", "ZeRO-1, 2 ranks [0.4, 0.2], 2 hosts", (1, 1), (0.4, 0.2), (2.0, 1.0), 24, 1, stage=1),
    "zero2": Row("zero2", "ZeRO-2, 2 ranks [0.4, 0.2], 2 hosts, gas 2", (1, 1), (0.4, 0.2), (2.0, 1.0), 24, 2,
                 stage=2),
    "zero3": Row("zero3", "ZeRO-3, 2 ranks [0.4, 0.2], 2 hosts", (1, 1), (0.4, 0.2), (2.0, 1.0), 24, 1, stage=3),
    "zero2-2x2": Row("zero2-2x2", "ZeRO-2, 2 hosts x 2 ranks at 0.25", (2, 2), (0.25, ) * 4, (1.0, ) * 4, 16, 1,
                     stage=2),
    "pipeline": Row("pipeline", "2-stage pipeline [0.4, 0.2], 2 hosts, 8 micro-batches", (1, 1), (0.4, 0.2),
                    (2.0, 1.0), 8 * PIPELINE_MICRO_BATCH, 8),
}


# -- calibration (this process, one thread) ------------------------------------------------------


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def calibrate_gpt(micro_batch=8, repeats=7):
    """Seconds of one sample's forward+backward (own CPU time) of the rows' GPT, one thread."""
    import torch
    from examples.tiny_gpt import GPT as Model, GPTConfig, TokenDataset, split_batch
    torch.set_num_threads(1)
    model = Model(GPTConfig(**GPT), seed=0)
    data = TokenDataset(seq_len=GPT["seq_len"], num_samples=micro_batch, seed=0)
    inputs, targets = split_batch(torch.stack([data[i] for i in range(micro_batch)]))

    def once():
        model.zero_grad(set_to_none=True)
        model(inputs, targets).backward()

    once()
    return _median_seconds(once, repeats) / micro_batch


def calibrate_blocks(micro_batch=PIPELINE_MICRO_BATCH, repeats=7):
    """The same for the pipeline's residual MLP blocks, all of them: ``(seconds per sample, activation
    bytes per sample)``, the latter what autograd saves for the backward (each storage once), since
    the plan's activation estimate is a decoder's."""
    import torch
    from plan_accuracy_rank import BLOCKS, WIDTH, Block
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)])
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(micro_batch, WIDTH, generator=generator), torch.randn(micro_batch, WIDTH,
                                                                                       generator=generator)

    def once():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()

    once()
    saved = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad is not None:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    activations = sum(size for pointer, size in saved.items() if pointer not in parameters)
    return _median_seconds(once, repeats) / micro_batch, activations / micro_batch


def _calibration_worker(barrier, pipeline, queue):
    """One of the calibrating processes (``calibrate``): each measurement starts with the others'."""
    from deepspeed.runtime.heterogeneous.memory.meter import fix_host_allocator_threshold
    fix_host_allocator_threshold()
    found = {}
    barrier.wait()
    if pipeline:
        found["blocks_sample_s"], found["blocks_activation_bytes_per_sample"] = calibrate_blocks()
    else:
        found["gpt_sample_s"] = calibrate_gpt()
    barrier.wait()
    found["adam_bytes_per_s"] = calibrate_adam()
    queue.put(found)


def calibrate(pipeline, processes=CALIBRATION_PROCESSES):
    """The kind's measured numbers for a row (module docstring), taken just before it: ``processes``
    processes of one thread each measure at once, as the ranks run (every core busy), with the fork's
    host allocator setting (the memory meter fixes glibc's mmap threshold on CPU ranks, so each large
    tensor is mapped afresh: compute costs more CPU time, the more so with every core busy); the mean
    of their medians. ``pipeline``: the pipeline's blocks, else the GPT."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_calibration_worker, args=(barrier, pipeline, queue)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    found = [queue.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    return {key: statistics.mean(f[key] for f in found) for key in found[0]}


def calibrate_adam(elements=2_000_000, repeats=7):
    """Bytes per second of torch's Adam on one flat fp32 tensor, in the bytes the plan counts for an
    optimizer step (``cluster_plan.optimizer_seconds``: parameters and gradients 4 bytes each read
    and written, Adam's 8, all touched twice)."""
    import torch
    torch.set_num_threads(1)
    parameter = torch.nn.Parameter(torch.zeros(elements))
    parameter.grad = torch.randn(elements)
    optimizer = torch.optim.Adam([parameter], lr=1e-3)
    optimizer.step()
    seconds = _median_seconds(optimizer.step, repeats)
    counted = (4 * 2 + 8) * 2.0
    return counted * elements / seconds


# -- the plan --------------------------------------------------------------------------------------


def gpt_numbers():
    """The rows' GPT as plan numbers (counted from the module, as ``repo_model`` counts)."""
    from examples.tiny_gpt import GPT as Model, GPTConfig
    model = Model(GPTConfig(**GPT), seed=0)
    parameters = [p.numel() for p in model.parameters()]
    return {"name": f"tiny_gpt d{GPT['d_model']} x{GPT['n_layer']}", "parameters": sum(parameters),
            "layers": GPT["n_layer"], "hidden": GPT["d_model"], "heads": GPT["n_head"], "vocab": GPT["vocab_size"],
            "seq_len": GPT["seq_len"], "largest_tensor": max(parameters)}


def kind(name, rate_samples_per_s, flops_per_sample, memory_gb, bandwidth):
    """A device kind by numbers: the achieved rate as its fp32 peak (efficiency 1)."""
    return {"name": name, "fp32_tflops": rate_samples_per_s * flops_per_sample / 1e12, "memory_gb": memory_gb,
            "memory_bandwidth_gb_s": bandwidth / 1e9, "cpu": True}


def cluster_description(row, model, flops_per_sample, sample_seconds, bandwidth, link_bits):
    """The cluster file of ``row`` with the measured kinds and link."""
    hosts, rank = [], 0
    for index, count in enumerate(row.ranks_per_host):
        devices = []
        for _ in range(count):
            speed, memory = row.speeds[rank], row.memory_gb[rank]
            devices.append({"kind": kind(f"cpu-core x{speed:g} (measured)", speed / sample_seconds, flops_per_sample,
                                         memory, bandwidth), "count": 1})
            rank += 1
        hosts.append({"name": f"host{index}", "devices": devices,
                      "intra_host_link": {"gbit_per_s": INTRA_HOST_GBIT, "latency_us": LATENCY_US}})
    return {"name": row.label, "hosts": hosts,
            "inter_host_link": {"gbit_per_s": link_bits / 1e9, "latency_us": LATENCY_US},
            "model": model,
            "training": {"train_batch_size": row.train_batch_size, "gradient_accumulation_steps": row.gas,
                         "precision": "fp32", "zero_stage": row.stage, "efficiency": 1.0,
                         "hbm_utilization_threshold": 0.85},
            "ds_config": {"optimizer": OPTIMIZER, "steps_per_print": 10**6}}


def plan_zero(description):
    from deepspeed.runtime.heterogeneous.forecast.cluster_file import parse_cluster
    from deepspeed.runtime.heterogeneous.forecast.cluster_plan import plan_cluster
    return plan_cluster(parse_cluster(description, source="bench"), largest=False)


def pinned_config(row, plan):
    """The plan's ds_config with its choice pinned (module docstring)."""
    fork = plan["fork"]
    ds = json.loads(json.dumps(plan["ds_config"]))
    ds["heterogeneous_config"].update({
        "load_balancing_strategy": "manual", "micro_batch_sizes": [r["micro_batch"] for r in fork["ranks"]],
        "profile_steps": 0, "mixed_precision_support": "fp32",
        "emulation": {"speeds": list(row.speeds), "mode": "dilation", "dilation_clock": "own"},
        "communication": {"hierarchical_reduction": False, "overlap": False, "zero3_host_shards": False,
                          "link_aware_buckets": False}})
    shares = [r["share"] for r in fork["ranks"]]
    if row.stage >= 1 and len(set(shares)) > 1:
        ds["heterogeneous_memory"]["zero_partitions"] = shares
    elif row.stage >= 1:
        ds["heterogeneous_memory"]["zero_partitions"] = "even"
    return ds


# -- the runs --------------------------------------------------------------------------------------


def measure_link(cluster, repeats=3, megabytes=8.0):
    """The payload rate of the link between host 0 and host 1 with a transfer each way at once, as a
    ring collective uses it (every rank sends and receives at the same time; the two directions'
    tbf queues then also carry each other's acknowledgements): the median over ``repeats`` of the two
    directions' mean, in bits/s."""
    import threading
    rates = []
    for _ in range(repeats):
        found = {}

        def probe(source, destination):
            found[source] = cluster.measure_rate(source, destination, megabytes=megabytes)

        threads = [threading.Thread(target=probe, args=pair) for pair in ((0, 1), (1, 0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rates.append(statistics.mean(found.values()))
    return statistics.median(rates)


def read_link(cluster, index):
    """(sent bytes, sent packets, received bytes, received packets) of host ``index``'s link."""
    import emulated_cluster as ec
    host = cluster.hosts[index]
    received = ec.parse_tc_sent(ec._run(["tc", "-s", "qdisc", "show", "dev", host.veth]).stdout)
    sent = ec.parse_tc_sent(ec._run(["ip", "netns", "exec", host.namespace, "tc", "-s", "qdisc", "show", "dev",
                                     ec.INTERFACE]).stdout)
    return sent + received


def payload_per_step(marks, host, short, long):
    """(sent, received) payload bytes per step of ``host``'s link: (c - b) - (b - a) over the step
    difference, frame headers taken off per packet."""
    from bench_communication import step_bytes
    values = []
    for offset in (0, 2):
        wire = step_bytes([marks[m][host][offset] for m in "abc"], short, long)
        packets = step_bytes([marks[m][host][offset + 1] for m in "abc"], short, long)
        values.append(wire - FRAME_HEADER_BYTES * packets)
    return tuple(values)


def run_row(cluster, row, spec, timeout=420):
    """Launch the rank script on every host; returns (rank results, marks)."""
    from bench_communication import launch_answering_marks
    with tempfile.TemporaryDirectory(prefix="bench_plan_accuracy_") as folder:
        out = Path(folder)
        (out / "spec.json").write_text(json.dumps(spec))
        argv = ["--spec", str(out / "spec.json"), "--out", str(out)]
        marks, run = launch_answering_marks(cluster, RANK_SCRIPT, argv, out, lambda host: read_link(cluster, host),
                                            timeout)
        results = [out / f"rank{r}.json" for r in range(cluster.world_size)]
        if run is None or not run.ok or not all(path.exists() for path in results):
            raise RuntimeError(f"row {row.name} failed:\n{run.describe() if run is not None else 'no launch'}")
        return [json.loads(path.read_text()) for path in results], marks


def measured_step_seconds(rank0):
    """The median interval between consecutive step ends on rank 0, the interval across mark b left out."""
    ends, short = rank0["step_ends"], rank0["short"]
    intervals = [b - a for i, (a, b) in enumerate(zip(ends, ends[1:])) if i + 1 != short]
    return statistics.median(intervals), intervals


def breakdown(rank):
    """Per rank, the median over the timed steps of its seconds in collectives (waits for peers
    included), slept by dilation, of its main thread's CPU time and of its waits for a core."""
    names, steps = rank["step_parts"]["names"], rank["step_parts"]["steps"]
    return {name: statistics.median(step[i] for step in steps) for i, name in enumerate(names)}


def relative(predicted, measured):
    return (predicted - measured) / measured


def worst_memory(errors):
    under = [e for e in errors if e < 0]
    return min(under) if under and min(under) < -max(errors) else max(errors, key=abs)


def zero_row(cluster, row, calibration, link_bits):
    model = gpt_numbers()
    from deepspeed.runtime.heterogeneous.forecast.model_description import describe_model
    flops = describe_model(model).flops_per_sample(GPT["seq_len"])
    description = cluster_description(row, model, flops, calibration["gpt_sample_s"], calibration["adam_bytes_per_s"],
                                      link_bits)
    plan = plan_zero(description)
    fork = plan["fork"]
    if not fork["fits"]:
        raise RuntimeError(f"row {row.name}: the plan does not fit: {fork['problems']}")
    config = pinned_config(row, plan)
    warmup, short, long = row.steps
    spec = {"kind": "zero", "ds_config": config, "model": GPT, "world_size": cluster.world_size,
            "micro_batch_sizes": config["heterogeneous_config"]["micro_batch_sizes"], "warmup": warmup,
            "short": short, "long": long,
            "memory_limit_bytes": [int(g * 2**30) for g in row.memory_gb]}
    ranks, marks = run_row(cluster, row, spec)
    return summarise(row, description, plan_summary(fork), ranks, marks, config)


def blocks_numbers(activation_bytes_per_sample):
    """The pipeline's blocks as plan numbers: counted from the module; FLOPs 6 per parameter and
    sample (no sequence); the activations measured (``calibrate_blocks``)."""
    import torch
    from plan_accuracy_rank import BLOCKS, WIDTH, Block
    sizes = [p.numel() for p in Block().parameters()]
    parameters = BLOCKS * sum(sizes)
    del torch
    return {"name": f"{BLOCKS} residual MLP blocks", "parameters": parameters, "layers": BLOCKS, "hidden": WIDTH,
            "seq_len": 1, "flops_per_sample": 6.0 * parameters,
            "activation_bytes_per_sample": activation_bytes_per_sample, "largest_tensor": max(sizes)}


def pipeline_row(cluster, row, calibration, link_bits):
    from deepspeed.runtime.heterogeneous.forecast.cluster_file import parse_cluster
    from deepspeed.runtime.heterogeneous.forecast.pipeline_plan import plan_pipeline
    model = blocks_numbers(calibration["blocks_activation_bytes_per_sample"])
    description = cluster_description(row, model, model["flops_per_sample"], calibration["blocks_sample_s"],
                                      calibration["adam_bytes_per_s"], link_bits)
    description["training"].pop("zero_stage")
    plan = plan_pipeline(parse_cluster(description, source="bench"))
    if not plan["fits"]:
        raise RuntimeError(f"row {row.name}: the plan does not fit: {plan['problems']}")
    config = {"train_batch_size": row.train_batch_size, "gradient_accumulation_steps": row.gas,
              "steps_per_print": 10**6, "optimizer": OPTIMIZER,
              "heterogeneous_config": {"enabled": True, "profile_steps": 0, "mixed_precision_support": "fp32",
                                       "pipeline": {"stage_layers": plan["stage_layers"], "layer_cost": "parameters"},
                                       "emulation": {"speeds": list(row.speeds), "mode": "dilation",
                                                     "dilation_clock": "own"}}}
    warmup, short, long = row.steps
    spec = {"kind": "pipeline", "ds_config": config, "world_size": cluster.world_size, "warmup": warmup,
            "short": short, "long": long, "memory_limit_bytes": [int(g * 2**30) for g in row.memory_gb]}
    ranks, marks = run_row(cluster, row, spec)
    predicted = {"step_s": plan["step_s"], "compute_s": plan["compute_s"], "communication_s": plan["communication_s"],
                 "optimizer_s": plan["optimizer_s"], "bytes_per_step": plan["bytes_per_boundary_per_step"],
                 "stage_layers": plan["stage_layers"], "micro_batches": [plan["micro_batch"]] * plan["micro_batches"],
                 "peak_bytes": [r["predicted_peak_bytes"] for r in plan["ranks"]],
                 "peak_phase": [r["peak_phase"] for r in plan["ranks"]],
                 "activation_bytes": [r["activation_bytes"] for r in plan["ranks"]],
                 "compute_s_per_micro_batch": [r["compute_s_per_micro_batch"] for r in plan["ranks"]],
                 "activation_bytes_per_sample": plan["activation_bytes_per_sample"]}
    return summarise(row, description, predicted, ranks, marks, config)


def plan_summary(fork):
    return {"step_s": fork["step_s"], "compute_s": fork["compute_s"], "communication_s": fork["communication_s"],
            "optimizer_s": fork["optimizer_s"], "bytes_per_step": fork["bytes_per_rank_per_step"],
            "micro_batches": [r["micro_batch"] for r in fork["ranks"]],
            "peak_bytes": [r["predicted_peak_bytes"] for r in fork["ranks"]],
            "peak_phase": [r["peak_phase"] for r in fork["ranks"]], "shares": fork.get("partition_shares"),
            "peak_by_phase": [r["peak_by_phase"] for r in fork["ranks"]],
            "activation_bytes_per_sample": fork["activation_bytes_per_sample"],
            "zero_stage": fork["zero_stage"], "gas": fork["gradient_accumulation_steps"]}


def summarise(row, description, predicted, ranks, marks, config):
    warmup, short, long = row.steps
    step_s, intervals = measured_step_seconds(ranks[0])
    slow_host = len(row.ranks_per_host) - 1
    sent, received = payload_per_step(marks, slow_host, short, long)
    measured_bytes = (sent + received) / 2
    peaks = [r["peak_bytes"] for r in ranks]
    memory_errors = [relative(p, m) for p, m in zip(predicted["peak_bytes"], peaks)]
    return {
        "name": row.name, "label": row.label, "ranks_per_host": list(row.ranks_per_host), "speeds": list(row.speeds),
        "memory_gb": list(row.memory_gb), "train_batch_size": row.train_batch_size,
        "cluster": description, "ds_config": config, "predicted": predicted,
        "measured": {"step_s": step_s, "step_intervals_s": intervals, "peak_bytes": peaks,
                     "joined_bytes": [r["joined_bytes"] for r in ranks], "bytes_per_step": measured_bytes,
                     "after_start_bytes": [r["after_start_bytes"] for r in ranks],
                     "phase_peaks": [r["phase_peaks"] for r in ranks],
                     "peak_before_timed_steps": [r["peak_before_timed_steps"] for r in ranks],
                     "bytes_sent_received": [sent, received],
                     "micro_batches": ranks[0]["micro_batch_sizes"], "shares": ranks[0]["partition_shares"],
                     "parts": ranks[0]["parts"], "emulation_mode": ranks[0]["emulation_mode"],
                     "losses_rank0": ranks[0]["losses"], "breakdown": [breakdown(r) for r in ranks],
                     "phase_seconds": [r["phase_seconds"] for r in ranks]},
        "step_time_error": relative(predicted["step_s"], step_s),
        "memory_errors": memory_errors, "memory_error": worst_memory(memory_errors),
        "bytes_error": relative(predicted["bytes_per_step"], measured_bytes),
    }


# -- the table -------------------------------------------------------------------------------------


def verdicts(rows):
    steps = [abs(r["step_time_error"]) for r in rows]
    out = {"step_median": statistics.median(steps) <= GOALS["step_median"] if steps else None,
           "step_worst": max(steps) <= GOALS["step_worst"] if steps else None}
    for r in rows:
        r["meets"] = {"step": abs(r["step_time_error"]) <= GOALS["step_worst"],
                      "memory": all(-GOALS["memory_under"] <= e <= GOALS["memory_within"] for e in r["memory_errors"]),
                      "bytes": abs(r["bytes_error"]) <= GOALS["bytes_within"]}
    out["memory"] = all(r["meets"]["memory"] for r in rows)
    out["bytes"] = all(r["meets"]["bytes"] for r in rows)
    return out


def table(result):
    """The docs' table of ``result`` (``scripts/render_benchmarks.py``'s renderer)."""
    from render_benchmarks import render_plan_accuracy
    return render_plan_accuracy([result])


class Progress:
    def __init__(self, names):
        self.names, self.began, self.done = list(names), time.monotonic(), []

    def row(self, name, text):
        self.done.append(time.monotonic())
        elapsed = self.done[-1] - self.began
        left = len(self.names) - len(self.done)
        per_row = elapsed / len(self.done)
        print(f"[{elapsed:6.0f} s] {name}: {text}; {left} row(s) left, about {left * per_row:.0f} s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import emulated_cluster as ec
    reason = ec.available()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    began = time.monotonic()
    load_before = os.getloadavg()
    progress = Progress(args.rows)
    rows = []
    layouts = {}
    for name in args.rows:
        layouts.setdefault(ROWS[name].ranks_per_host, []).append(name)
    for layout, names in layouts.items():
        specs = [ec.HostSpec(ranks=count, rate_mbit=RATE_MBIT) for count in layout]
        with ec.EmulatedCluster(specs) as cluster:
            link_bits = measure_link(cluster)
            for name in names:
                row = ROWS[name]
                calibration = dict(calibrate(row.stage is None), link_bits_per_s=link_bits,
                                   load_average=os.getloadavg()[0])
                print(f"[{time.monotonic() - began:6.0f} s] {name}: measured " + ", ".join(
                    f"{key} {value:.4g}" for key, value in calibration.items()), flush=True)
                if row.stage is None:
                    result = pipeline_row(cluster, row, calibration, link_bits)
                else:
                    result = zero_row(cluster, row, calibration, link_bits)
                result["calibration"] = calibration
                rows.append(result)
                progress.row(name, f"step {result['step_time_error']:+.1%}, memory {result['memory_error']:+.1%}, "
                             f"bytes {result['bytes_error']:+.1%}")
    goals = verdicts(rows)
    result = {"rows": rows, "goals": GOALS, "met": goals,
              "load_average": {"before": load_before, "after": os.getloadavg()}, "seconds": time.monotonic() - began,
              "command": "python tests/perf/bench_plan_accuracy.py " + " ".join(argv if argv is not None else
                                                                                sys.argv[1:]),
              "torch": __import__("torch").__version__}
    print(table(result))
    print(f"goals met: {goals}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; python scripts/render_benchmarks.py renders it into the docs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
