# SPDX-License-Identifier: Apache-2.0
"""``plan_pipeline``: a heterogeneous pipeline on a described cluster, predicted as plain data.

One replica of the model's layers cut into one stage per rank, in rank order (stage s on rank s,
as ``PipelineModule`` places stages when the data-parallel size is 1), trained with DeepSpeed's
1F1B schedule of ``m = gradient_accumulation_steps`` micro-batches of ``b`` samples, ZeRO off (the
pipeline engine's default). With the fork's own parts and no process group:

- the cut: ``planning.stages.partition_stages`` over the layers' parameters as their costs and the
  ranks' rates (datasheet peak times the efficiency prior, or a kind given by numbers) as the
  stages' speeds, as the fork cuts a ``PipelineModule(partition_method="heterogeneous")`` with
  ``pipeline.layer_cost: "parameters"``; ``stage_layers`` pins another cut;
- compute: stage s spends ``t_s = b * (its layers' share of the FLOPs per sample) / rate_s`` on a
  micro-batch (forward and backward); a 1F1B step takes ``sum(t_s) + (m - 1) * max(t_s)`` (the
  fill and drain pass every stage once, the slowest stage sets the pace in between);
- transfers: each micro-batch's boundary activations go forward and their gradients come back,
  ``b * seq_len * hidden * value_bytes`` each, over the link between the two stages' ranks (the
  inter-host link across hosts); the prediction adds ``2 * (m + S - 2)`` of them (every
  micro-batch through the slowest stage's boundary both ways, and the fill and drain through the
  other boundaries), each ``bytes / bandwidth + latency``;
- optimizer step: the slowest stage's, its parameters, gradients and optimizer state read and
  written at its memory bandwidth (``cluster_plan.optimizer_seconds``);
- memory: per stage, ``memory/peak.py``'s ZeRO-0 phases for the stage's parameters on one
  data-parallel rank (the pipeline engine still flattens the gradients for its all-reduce), with
  the activations of the micro-batches 1F1B keeps in flight on stage s, ``min(m, S - s)``; the
  layers' activations are the model's estimate (``model_description``) split evenly over its
  layers, the logits' part on the last stage.

Not modelled: the pipeline engine's own buffers (each stage's received and sent boundary tensors,
small beside the activations), tied layers, the model's parameters outside its layers (the
embeddings and the head: they are counted on the first stage and their compute is not), data
parallelism of the pipeline (one replica), ZeRO-1 in a pipeline.
"""

from dataclasses import replace

from ..memory.peak import predict_peak
from ..memory.spec import ModelStateSpec
from ..planning.stages import given_partition, partition_stages
from .cluster_plan import optimizer_seconds
from .question import peak_flops, settle_question, with_stage


def plan_pipeline(cluster, model=None, ds_config=None, training=None, stage_layers=None):
    """The prediction for ``cluster`` (a ``ClusterDescription`` or a file's path) trained as a pipeline
    of one stage per rank; ``model``, ``ds_config`` and ``training`` override the file's (as
    ``plan_cluster``); ``stage_layers``: layers per stage (default: the fork's cut)."""
    if isinstance(cluster, str):
        from .cluster_file import load_cluster_file
        cluster = load_cluster_file(cluster)
    question = settle_question(cluster, model, ds_config, dict(training or {}, zero_stage=0))
    model = question.model
    stages, layers = cluster.world_size, model.layers
    if not layers or layers < stages:
        raise ValueError(f"a pipeline of {stages} stages needs a model of at least {stages} layers "
                         f"(the model's layers: {layers or 'unknown'}): give 'layers' in its description")
    gas = question.gas
    if gas is None:
        raise ValueError("a pipeline's micro-batches per step: give training.gradient_accumulation_steps")
    batch = question.train_batch_size
    if batch % gas:
        raise ValueError(f"train_batch_size {batch} is not {gas} micro-batches of one size")
    micro = batch // gas
    rates = [peak_flops(r.spec, question.precision) * question.efficiency for r in cluster.ranks]  # FLOP/s
    costs = [float(model.per_layer_parameters)] * layers
    if stage_layers is not None:
        if len(stage_layers) != stages or sum(stage_layers) != layers or min(stage_layers) < 1:
            raise ValueError(f"stage_layers {list(stage_layers)} must give each of the {stages} stages at least one "
                             f"layer and sum to the model's {layers}")
        parts = [0]
        for count in stage_layers:
            parts.append(parts[-1] + int(count))
        partition = given_partition(parts, costs, rates, "manual")
    else:
        partition = partition_stages(costs, rates)
    parts = list(partition.parts)
    flops_per_layer = model.flops_per_sample(question.seq_len) / layers
    per_sample = model.activation_bytes_per_sample(question.seq_len, question.value_bytes, question.checkpointing)
    logits = 8.0 * question.seq_len * model.vocab if model.activation_override is None and model.vocab else 0.0
    per_layer_activations = None if per_sample is None else (per_sample - logits) / layers
    boundary = float(question.seq_len) * model.hidden * question.value_bytes if model.hidden else None
    ds = with_stage(question.ds_config, 0, gas)

    ranks = []
    for s, device in enumerate(cluster.ranks):
        held = parts[s + 1] - parts[s]
        parameters = held * model.per_layer_parameters + (model.base_parameters if s == 0 else 0)
        seconds = micro * held * flops_per_layer / rates[s]
        spec = ModelStateSpec.for_config_dict(ds, parameters, question.precision != "fp32", world=1,
                                              emulated_device=not device.cpu)
        # No baseline: the stage's own parameters are counted (ZeRO-0 trains them in place).
        spec = replace(spec, allocations=replace(spec.allocations, largest_parameter=model.largest_tensor,
                                                 parameters_resident=False))
        in_flight = min(gas, stages - s)
        activations = 0.0
        if per_layer_activations is not None:
            activations = in_flight * micro * (held * per_layer_activations + (logits if s == stages - 1 else 0.0))
        peak = predict_peak(spec.allocations, activation_bytes=activations)
        placed = _Placed(share=1.0, offload_fraction=0.0)
        ranks.append({"rank": s, "stage": s, "host": device.host_name, "kind": device.spec.kind or device.spec.name,
                      "layers": [parts[s], parts[s + 1]], "parameters": parameters, "micro_batch": micro,
                      "micro_batches": gas, "compute_s_per_micro_batch": seconds,
                      "micro_batches_in_flight": in_flight, "activation_bytes": activations,
                      "predicted_peak_bytes": peak.peak_bytes, "peak_phase": peak.peak_phase,
                      "capacity_bytes": device.memory_bytes,
                      "fits": peak.peak_bytes <= question.utilization * device.memory_bytes,
                      "optimizer_s": optimizer_seconds(spec, placed, device, question)})
    times = [r["compute_s_per_micro_batch"] for r in ranks]
    compute = sum(times) + (gas - 1) * max(times)
    slowest = max(range(stages), key=lambda s: times[s])
    link, where = _boundary_link(cluster, slowest)
    transfer_bytes = None if boundary is None else micro * boundary
    transfers = 2 * (gas + stages - 2)
    comm = 0.0 if transfer_bytes is None else transfers * (transfer_bytes / link.bytes_per_s + link.latency_us * 1e-6)
    optimizer = max(r["optimizer_s"] for r in ranks)
    step = compute + comm + optimizer
    problems = [f"stage {r['stage']} ({r['kind']}) needs {r['predicted_peak_bytes'] / 2**30:.2f} GiB of "
                f"{question.utilization:.2f} x {r['capacity_bytes'] / 2**30:.2f} GiB" for r in ranks if not r["fits"]]
    return {"name": "pipeline", "stages": stages, "stage_layers": [b - a for a, b in zip(parts, parts[1:])],
            "parts": parts, "cut": partition.method, "micro_batch": micro, "micro_batches": gas,
            "fits": not problems, "problems": problems, "step_s": step, "samples_per_s": batch / step,
            "compute_s": compute, "communication_s": comm, "optimizer_s": optimizer,
            "slowest_stage": slowest, "slowest_link": where,
            "bytes_per_boundary_per_step": None if transfer_bytes is None else int(gas * transfer_bytes),
            "activation_bytes_per_sample": per_sample, "ranks": ranks,
            "assumptions": list(question.assumptions)}


class _Placed:
    """What ``optimizer_seconds`` reads of a placed rank: a stage holds its layers' whole state."""

    def __init__(self, share, offload_fraction):
        self.share, self.offload_fraction = share, offload_fraction


def _boundary_link(cluster, stage):
    """The slowest link of stage ``stage``'s boundaries (to the stages before and after it)."""
    links = []
    for other in (stage - 1, stage + 1):
        if 0 <= other < cluster.world_size:
            a, b = cluster.ranks[stage], cluster.ranks[other]
            links.append((cluster.inter_host_link, "inter-host") if a.host != b.host else
                         (cluster.intra_host_links[a.host], "intra-host"))
    return min(links, key=lambda pair: pair[0].gbit_per_s)
