# SPDX-License-Identifier: Apache-2.0
"""Per-rank offload beside the multi-host communication features, on 2 hosts x 2 ranks.

Hosts are faked with ``CROSS_RANK`` (as in test_hierarchical.py): ranks 0-1 on one host, 2-3 on the
other, so the hierarchical reduction is in force. ``heterogeneous_memory`` with even shares and
``heterogeneous_offload.cpu_offload``; rank 3's emulated memory holds its shard only with its optimizer
state on the host, so rank 3 alone offloads. Upstream's offloaded path sets the optimizer's offload
flag on rank 3 only; the communication features must be decided from the agreed offload set, so that
every rank decides alike. For each of ``overlap`` (ZeRO-2), ``overlap_parameter_gather`` (ZeRO-2; true
or false) and ``zero3_host_shards`` (ZeRO-3) set to true, false and "auto", one after the other in one group of
ranks (each engine destroyed before the next): the run either trains exactly like one process's Adam
on the global batch, or every rank stops with the same one error, naming rank 3 and why.
"""

import pytest
import torch

from harness import run_subcases

SIZES = [3, 2, 2, 1]
HOSTS = [0, 0, 1, 1]
STEPS, LR, WIDTH, HIDDEN = 3, 1e-2, 64, 512
UTILIZATION = 0.9
BUCKET = 65536  # two of the largest parameters: the buckets stay below the optimizer state


def _model():
    torch.manual_seed(20261207)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))


def _batches():
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(sum(SIZES), WIDTH, generator=generator), torch.randn(sum(SIZES), WIDTH, generator=generator))
            for _ in range(STEPS)]


def _memory_gb(stage, host_shards):
    """Ranks 0-2 with plenty of room; rank 3 with a budget (``UTILIZATION`` of its capacity) that holds its
    even shard only once its optimizer state (Adam's moments and the fp32 partition ZeRO keeps) is on the
    host, as the pool predicts the peaks (on 4 ranks offloading saves little: halfway between the two).
    ``host_shards``: ZeRO-3's host shards are in force, half of the host's copy and its refresh buffers."""
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from deepspeed.runtime.heterogeneous.memory.peak import ZeroAllocations, predict_peak
    numels = [p.numel() for p in _model().parameters()]
    allocations = ZeroAllocations(num_parameters=sum(numels), largest_parameter=max(numels), zero_stage=stage,
                                  world=len(SIZES), optimizer_bytes=8, optimizer_temporaries=2,
                                  overlap_comm=stage == 3, sub_group_size=1, foreach=True, host_is_device=False,
                                  reduce_bucket=BUCKET, allgather_bucket=BUCKET, prefetch_bucket=BUCKET,
                                  max_live_parameters=BUCKET, max_reuse_distance=BUCKET)
    shard = {"host_shard": 0.5, "hosts": 2} if host_shards else {}
    offloaded, kept = (predict_peak(allocations, share=1 / len(SIZES), offloaded=f, **shard).peak_bytes
                       for f in (1.0, 0.0))
    assert offloaded < kept, (offloaded, kept)
    return [1.0, 1.0, 1.0, (offloaded + kept) / 2 / UTILIZATION / BYTES_PER_GB]


def _config(stage, communication):
    host_shards = stage == 3 and communication.get("zero3_host_shards", "auto") is not False
    zero = {"stage": stage, "heterogeneous_offload": {"cpu_offload": True}, "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET,
            "stage3_max_live_parameters": BUCKET, "stage3_max_reuse_distance": BUCKET}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=1)
    return {"train_batch_size": sum(SIZES), "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero,
            "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": SIZES,
                                     "communication": communication,
                                     "emulation": {"memory_gb": _memory_gb(stage, host_shards), "mode": "dilation"}},
            "heterogeneous_memory": {"enabled": True, "zero_partitions": "even",
                                     "hbm_utilization_threshold": UTILIZATION,
                                     "adaptive_chunking": False}}


def _run(rank, world_size, stage, key, value):
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.config.settings import HeterogeneousConfigError

    model = _model()
    with patched_environ({"CROSS_RANK": HOSTS[rank]}):
        try:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(stage, {key: value}))
        except HeterogeneousConfigError as exc:
            return {"error": str(exc)}
    state = engine._config.heterogeneous
    offset = sum(SIZES[:rank])
    for inputs, targets in _batches():
        rows = slice(offset, offset + SIZES[rank])
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows]))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    offloaded = list(state.offloaded_ranks)
    engine.destroy()
    return {"params": params, "offloaded": offloaded}


def _reference():
    """One process, torch's Adam on the whole global batch: the mean over its rows (each rank's loss
    is the mean over its own rows, which the fork weights by its share). Adam, not SGD: the offload
    that shapes these decisions exists for an optimizer's state (SGD's fp32 partition alone frees less
    than the offloaded path's buffers cost); the split's loss weights are checked against SGD by
    test_exactness.py and test_zero3_shards.py."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    initial = [p.detach().clone() for p in model.parameters()]
    for inputs, targets in _batches():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return initial, [p.detach().clone() for p in model.parameters()]


SETTINGS = {"overlap": (2, (True, False, "auto")), "overlap_parameter_gather": (2, (True, False)),
            "zero3_host_shards": (3, (True, False, "auto"))}
CASES = [dict(stage=stage, key=key, value=value) for key, (stage, values) in SETTINGS.items() for value in values]


@pytest.mark.multiprocess
def test_every_feature_setting_trains_exactly_or_stops_every_rank_naming_the_offloading_rank():
    results = run_subcases(_run, CASES, world_size=len(SIZES), timeout=900)
    initial, expected = _reference()
    outcomes = {}
    for case, per_rank in zip(CASES, results):
        name = f"{case['key']}={case['value']!r}"
        errors = [r.get("error") for r in per_rank]
        if any(errors):
            # Every rank stops, with the same message, which names the offloading rank.
            assert len(set(errors)) == 1 and errors[0], (name, errors)
            assert "[3]" in errors[0] or "rank 3" in errors[0], (name, errors[0])
            outcomes[name] = "refused"
            continue
        for rank, result in enumerate(per_rank):
            assert result["offloaded"] == [3], (name, rank, result["offloaded"])
            for got, want, start in zip(result["params"], expected, initial):
                # Relative to the update; the hierarchical reduction sums in another order, which
                # Adam's normalisation lifts to ~2e-5 of the update where gradients are tiny.
                error = float((got - want).norm() / (want - start).norm())
                assert error < 1e-4, (name, rank, error)
        outcomes[name] = "trained"
    # false and "auto" always train. Overlapped reduction (and the parameter gather its worker runs)
    # does not apply beside an offloading rank: true is refused. Host shards do not depend on it.
    assert outcomes == {"overlap=True": "refused", "overlap=False": "trained", "overlap='auto'": "trained",
                        "overlap_parameter_gather=True": "refused", "overlap_parameter_gather=False": "trained",
                        "zero3_host_shards=True": "trained", "zero3_host_shards=False": "trained",
                        "zero3_host_shards='auto'": "trained"}, outcomes
