# SPDX-License-Identifier: Apache-2.0
"""``plan_cluster``: upstream's even split and the fork's choice on a described cluster, as plain data.

For each ZeRO stage tried and each number of micro-steps, both sides are predicted with the
fork's own parts and no process group:
- memory: ``HeterogeneousMemoryPool`` places ``ModelStateSpec.for_config_dict`` of the model on the
  ranks' datasheet capacities, with each rank's activations (``model_description``) for its
  micro-batch; upstream with even shares, no per-rank offload and the same micro-batch everywhere;
  the fork with ``"auto"`` shares and per-rank offload;
- time: ``time_models_from_scores`` of each rank's samples per second (datasheet peak times the
  efficiency prior over the model's FLOPs per sample) and ``plan_micro_batches`` (compute_aware
  within the micro-batches memory leaves, or uniform for upstream); the optimizer step reads and
  writes the rank's share of the state at its memory bandwidth (offloaded state: over PCIe, at
  host memory bandwidth); the collectives come from ``comm_model``;
- step time = the slowest rank's compute + the collectives + the slowest rank's optimizer step.
Each side keeps its fastest setting that fits (on a tie, the fewest micro-steps). The largest model of the
same family that each side fits is found by depth (``largest_model``).
"""

import threading
from dataclasses import replace

from ..measure.device_table import datasheet
from ..memory.pool import HeterogeneousMemoryPool
from ..memory.report import DEVICE
from ..memory.spec import ModelStateSpec
from ..planning.planner import plan_micro_batches, time_models_from_scores
from .comm_model import (bytes_over_link, collective_settings, communication_seconds, slowest_link,
                         zero_collectives)
from .question import peak_flops, settle_question, with_stage

PCIE_BYTES_PER_S = 25e9
"""Host-device copies of offloaded state: PCIe 4.0 x16 in practice (a prior)."""
HOST_MEMORY_BYTES_PER_S = 100e9
"""A host's memory bandwidth for the offloaded optimizer step (a prior)."""
OPTIMIZER_TOUCH_FACTOR = 2.0
"""An optimizer step reads and writes each byte of its state (and parameters, gradients) once."""


def plan_cluster(cluster, model=None, ds_config=None, training=None, largest=True):
    """The plan of ``cluster`` (a ``ClusterDescription`` or a file's path) as plain data (the
    layout is in docs/planning.md). ``model``, ``ds_config`` and ``training`` override the file's."""
    if isinstance(cluster, str):
        from .cluster_file import load_cluster_file
        cluster = load_cluster_file(cluster)
    question = settle_question(cluster, model, ds_config, training)
    try:
        return _plan(cluster, question, largest)
    finally:
        _PER_PLAN.value = None


def _plan(cluster, question, largest):
    upstream = best_setting(cluster, question, fork=False)
    fork = best_setting(cluster, question, fork=True)
    result = {
        "cluster": cluster_summary(cluster),
        "model": model_summary(question),
        "question": {"precision": question.precision, "train_batch_size": question.train_batch_size,
                     "seq_len": question.seq_len, "efficiency": question.efficiency,
                     "zero_stages_tried": list(question.stages), "activation_checkpointing": question.checkpointing,
                     "hbm_utilization_threshold": question.utilization},
        "priors": priors(cluster, question),
        "upstream": upstream,
        "fork": fork,
        "speedup": (fork["samples_per_s"] / upstream["samples_per_s"]
                    if fork["fits"] and upstream["fits"] else None),
    }
    if largest:
        result["largest_model"] = {"upstream": largest_model(cluster, question, False),
                                   "fork": largest_model(cluster, question, True)}
    result["ds_config"] = launch_config(question, fork, cluster)
    return result


def best_setting(cluster, question, fork):
    """The fastest setting that fits for one side, else the one that fails least badly."""
    candidates = []
    for stage in question.stages:
        for gas in gas_candidates(question, cluster.world_size):
            # More micro-steps cost collectives (ZeRO-2/3) but leave room for larger or more uneven
            # micro-batches: every count is tried.
            for shares in (("auto", "even") if fork and stage >= 1 else (None, )):
                candidates.append(evaluate(cluster, question, stage, gas, fork, shares))
    fitting = [c for c in candidates if c["fits"]]
    if fitting:
        return min(fitting, key=lambda c: (round(c["step_s"], 12), c["gradient_accumulation_steps"],
                                           c["zero_stage"]))
    return min(candidates, key=lambda c: (len(c["problems"]), -c["zero_stage"]))


def gas_candidates(question, world):
    if question.gas is not None:
        return [question.gas]
    batch = question.train_batch_size
    return [g for g in range(1, batch + 1) if batch % g == 0 and batch // g >= world]


def model_spec(cluster, question, stage, gas, model=None):
    model = model or question.model
    ds = with_stage(question.ds_config, stage, gas)
    on_host = all(r.cpu for r in cluster.ranks)  # CPU ranks: the device is the host
    spec = ModelStateSpec.for_config_dict(ds, model.num_parameters, question.precision != "fp32",
                                          world=cluster.world_size, emulated_device=not on_host)
    # No baseline in a plan: ZeRO-0 trains the module's own parameters, which must be counted; ZeRO-1/2/3
    # count their flat or partitioned copies, the originals' memory going back as they are replaced.
    return replace(spec, allocations=replace(spec.allocations, largest_parameter=model.largest_tensor,
                                             parameters_resident=stage >= 1)), ds


def memory_pool(cluster, question):
    """The pool of ``cluster`` for ``question``, built once per plan (it reads every rank) and placed
    again for every setting tried: ``place`` starts afresh."""
    return _per_plan(cluster, question)["pool"]


_PER_PLAN = threading.local()
"""What a plan computes once per rank (the pool, rates, time models), for the (cluster, question)
being planned, compared by identity: a plan of N ranks places some 100 settings, and each of these
is O(N). Per thread; ``plan_cluster`` drops it when it returns."""


def _per_plan(cluster, question):
    cached = getattr(_PER_PLAN, "value", None)
    if cached is None or cached["cluster"] is not cluster or cached["question"] is not question:
        flops = question.model.flops_per_sample(question.seq_len)
        rates = [peak_flops(r.spec, question.precision) * question.efficiency / flops for r in cluster.ranks]
        cached = _PER_PLAN.value = {"cluster": cluster, "question": question, "pool": _new_pool(cluster, question),
                                    "rates": rates, "models": time_models_from_scores(rates),
                                    "names": [r.spec.kind or r.spec.name for r in cluster.ranks]}
    return cached


def _new_pool(cluster, question):
    limits = [m for m in cluster.host_memory_bytes if m is not None]
    return HeterogeneousMemoryPool([r.memory_bytes for r in cluster.ranks],
                                   cpu_memory_limit=min(limits) if limits else None,
                                   hbm_utilization_threshold=question.utilization, hosts=cluster.hosts,
                                   speeds=[peak_flops(r.spec, question.precision) for r in cluster.ranks],
                                   device_names=[r.spec.kind or r.spec.name for r in cluster.ranks])


def activation_bytes(question, model=None):
    model = model or question.model
    return model.activation_bytes_per_sample(question.seq_len, question.value_bytes, question.checkpointing)


def place(cluster, question, spec, fork, micro_batches, model=None, shares=None):
    """The pool's placement; ``shares``: "auto" or "even" (default: "auto" for the fork)."""
    pool = memory_pool(cluster, question)
    per_sample = activation_bytes(question, model)
    activations = None if per_sample is None else [m * per_sample for m in micro_batches]
    shares = shares or ("auto" if fork else "even")
    placement = pool.place(spec, zero_partitions=shares, activation_bytes=activations,
                           cpu_offload=fork, nvme_offload=False, strict=False)
    return pool, placement, per_sample


def micro_batch_caps(placement, per_sample):
    """Per rank, the most samples per micro-step its memory holds (placed with one sample each)."""
    if per_sample is None or per_sample <= 0:
        return None
    caps = []
    for rank in placement.ranks:
        if rank.budget_bytes is None:
            caps.append(None)
            continue
        room = rank.budget_bytes - (rank.device_bytes - per_sample)
        caps.append(max(0, int(room // per_sample)))
    return caps


def evaluate(cluster, question, stage, gas, fork, shares=None):
    """One side's prediction at ``stage`` and ``gas`` (see the module docstring). ``shares``: the
    fork's ZeRO shares, "auto" (by speed and room) or "even"; the fork tries both, since shares by
    speed leave a fast rank less room for the larger micro-batch its speed asks for."""
    world, batch = cluster.world_size, question.train_batch_size
    spec, _ = model_spec(cluster, question, stage, gas)
    per_plan = _per_plan(cluster, question)
    rates, models, names = per_plan["rates"], per_plan["models"], per_plan["names"]
    problems = []
    if batch % gas or batch // gas < world:
        return _unfit(stage, gas, fork, [f"train_batch_size {batch} is not {gas} micro-steps of at least one sample "
                                         f"on each of {world} ranks"])
    if fork:
        _, first, per_sample = place(cluster, question, spec, True, [1] * world, shares=shares)
        caps = micro_batch_caps(first, per_sample)
        if caps is not None and min(caps) < 1:
            short = [r for r, c in enumerate(caps) if c < 1]
            return _unfit(stage, gas, fork, [f"ranks {short} cannot hold one sample"] + list(first.problems))
        try:
            plan = plan_micro_batches(models, batch, gas, "compute_aware", max_micro_batch=caps, device_names=names)
        except ValueError as exc:
            return _unfit(stage, gas, fork, [str(exc)])
        micro = list(plan.micro_batch_sizes)
    else:
        if (batch // gas) % world:
            return _unfit(stage, gas, fork, [f"{batch // gas} samples per micro-step do not split evenly over "
                                             f"{world} ranks"])
        micro = [batch // gas // world] * world
    pool, placement, per_sample = place(cluster, question, spec, fork, micro, shares=shares)
    problems += list(placement.problems)
    link, where = slowest_link(cluster)
    rank_shares = [r.share for r in placement.ranks]
    collectives = zero_collectives(stage, question.model.num_parameters, question.value_bytes, world, gas,
                                   max(rank_shares) if stage >= 1 else 1.0 / world, link,
                                   **collective_settings(cluster, question.ds_config, spec.allocations))
    ranks, phases, optimizer = [], {}, {}
    for placed, device, mbs, rate in zip(placement.ranks, cluster.ranks, micro, rates):
        compute = gas * mbs / rate
        alike = (placed.share, placed.offload_fraction, id(device.spec))
        if alike not in optimizer:
            optimizer[alike] = optimizer_seconds(spec, placed, device, question)
        ranks.append({
            "rank": placed.rank, "host": device.host_name, "kind": device.spec.kind or device.spec.name,
            "micro_batch": mbs, "gas": gas, "share": placed.share if stage >= 1 else None,
            "offload_fraction": placed.offload_fraction,
            "offload": placed.optimizer_location if placed.offload_fraction > 0 else DEVICE,
            "capacity_bytes": placed.capacity_bytes, "predicted_peak_bytes": placed.device_bytes,
            "peak_phase": placed.peak_phase, "peak_by_phase": _phases(pool, placed, mbs, per_sample, phases),
            "fits": placed.fits, "compute_s": compute,
            "optimizer_s": optimizer[alike]})
    compute_s = max(r["compute_s"] for r in ranks)
    optimizer_s = max(r["optimizer_s"] for r in ranks)
    comm_s = communication_seconds(collectives)
    step = compute_s + comm_s + optimizer_s
    return {"name": "fork" if fork else "upstream", "zero_stage": stage, "gradient_accumulation_steps": gas,
            "zero_partitions": shares or ("auto" if fork else "even"), "fits": not problems, "problems": problems,
            "step_s": step, "samples_per_s": batch / step,
            "compute_s": compute_s, "optimizer_s": optimizer_s, "communication_s": comm_s,
            "communication_share": comm_s / step, "slowest_link": where,
            "bytes_per_rank_per_step": int(bytes_over_link(collectives)),
            "collectives": [c.to_dict() for c in collectives],
            "partition_shares": None if placement.partition_shares is None else list(placement.partition_shares),
            "activation_bytes_per_sample": per_sample, "ranks": ranks}


def optimizer_seconds(spec, placed, device, question):
    """The rank's optimizer step: its state, master copy, parameters and gradients read and written
    at its memory bandwidth; the offloaded part at host bandwidth plus its gradients and parameters
    over PCIe."""
    elements = spec.num_parameters * (placed.share if spec.zero_stage >= 1 else 1.0)
    per_element = spec.param_bytes * 2 + spec.optimizer_bytes + (4 if spec.param_bytes < 4 else 0)
    offloaded = placed.offload_fraction
    bandwidth = device.spec.bandwidth_gbps * 1e9 or HOST_MEMORY_BYTES_PER_S
    on_device = elements * (1 - offloaded) * per_element * OPTIMIZER_TOUCH_FACTOR / bandwidth
    off_device = elements * offloaded * (per_element * OPTIMIZER_TOUCH_FACTOR / HOST_MEMORY_BYTES_PER_S +
                                         2 * spec.param_bytes / PCIE_BYTES_PER_S)
    return on_device + off_device


def _phases(pool, placed, micro_batch, per_sample, seen):
    """The rank's peak by phase; ``seen``: those of the predictions met before (ranks placed alike
    share one, ``predicted_peak``)."""
    peak = pool.predicted_peak(placed.rank, (per_sample or 0.0) * micro_batch)
    if peak is None:
        return None
    if id(peak) not in seen:
        seen[id(peak)] = (peak, {phase: int(peak.phase_bytes(phase)) for phase in peak.phases})
    return dict(seen[id(peak)][1])


def _unfit(stage, gas, fork, problems):
    return {"name": "fork" if fork else "upstream", "zero_stage": stage, "gradient_accumulation_steps": gas,
            "fits": False, "problems": problems, "step_s": None, "samples_per_s": None, "ranks": []}


def fits_one_sample(cluster, question, fork, stage, model):
    """Whether ``model`` trains on one side at ``stage`` with one sample per rank per micro-step
    (the smallest footprint the global batch allows)."""
    spec, _ = model_spec(cluster, question, stage, 1, model)
    _, placement, _ = place(cluster, question, spec, fork, [1] * cluster.world_size, model)
    return not placement.problems


def largest_model(cluster, question, fork, limit=1 << 16):
    """The deepest member of the model's family (``with_layers``) that one side fits with one
    sample per rank, at the highest ZeRO stage tried (the one that holds most):
    ``{"zero_stage", "layers", "parameters"}``; layers 0 when not even one layer fits."""
    model, stage = question.model, max(question.stages)

    def fits(layers):
        return fits_one_sample(cluster, question, fork, stage, model.with_layers(layers))

    if not fits(1):
        return {"zero_stage": stage, "layers": 0, "parameters": 0}
    low, high = 1, 2
    while high < limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return {"zero_stage": stage, "layers": low if model.layers else None,
            "parameters": model.with_layers(low).num_parameters}


def launch_config(question, fork, cluster):
    """The ds_config to launch the fork's choice with: the question's, at the chosen stage and gas,
    with the fork's blocks; the runtime measures the ranks and re-plans from its own timings."""
    stage = fork["zero_stage"]
    ds = with_stage(question.ds_config, stage, fork["gradient_accumulation_steps"])
    offloading = any(r["offload_fraction"] > 0 for r in fork["ranks"])
    if offloading:
        ds["zero_optimization"]["heterogeneous_offload"] = {"cpu_offload": True}
    ds["heterogeneous_config"] = {**ds.get("heterogeneous_config", {}), "enabled": True,
                                  "load_balancing_strategy": "compute_aware"}
    memory = {**ds.get("heterogeneous_memory", {}), "enabled": True,
              "hbm_utilization_threshold": question.utilization}
    if stage >= 1:
        memory["zero_partitions"] = fork.get("zero_partitions", "auto")
    limits = [m for m in cluster.host_memory_bytes if m is not None]
    if limits:
        memory["cpu_memory_limit"] = int(min(limits))
    ds["heterogeneous_memory"] = memory
    return ds


def cluster_summary(cluster):
    kinds = {}
    for rank in cluster.ranks:
        name = rank.spec.kind or rank.spec.name
        kinds[name] = kinds.get(name, 0) + 1
    inter = cluster.inter_host_link
    return {"name": cluster.name, "world_size": cluster.world_size, "hosts": len(cluster.host_names),
            "devices": kinds, "inter_host_gbit_per_s": None if inter is None else inter.gbit_per_s}


def model_summary(question):
    model = question.model
    return {"name": model.name, "source": model.source, "parameters": model.num_parameters, "layers": model.layers,
            "largest_tensor": model.largest_tensor, "flops_per_sample": model.flops_per_sample(question.seq_len),
            "activation_bytes_per_sample": activation_bytes(question)}


def priors(cluster, question):
    """Which numbers are datasheet priors or assumptions, not measurements."""
    notes = []
    for spec in {r.spec for r in cluster.ranks}:
        document, url = datasheet(spec)
        where = f"{document}, {url}" if document else "given by numbers in the cluster file"
        notes.append(f"{spec.kind or spec.name}: peak and memory from {where}")
    if any(link.assumed for link in cluster.intra_host_links):
        notes.append("intra-host links not given: PCIe 4.0 x16 assumed (200 Gbit/s, 5 us)")
    notes.append(f"PCIe {PCIE_BYTES_PER_S / 1e9:.0f} GB/s and host memory {HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s for "
                 f"offloaded optimizer state (priors)")
    notes.append("activations and FLOPs per sample: estimates from the model's shape, not measured")
    return sorted(notes[:-2]) + notes[-2:] + list(question.assumptions)
