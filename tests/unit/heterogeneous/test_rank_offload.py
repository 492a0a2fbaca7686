# SPDX-License-Identifier: Apache-2.0
"""Per-rank offload: with ``heterogeneous_memory.enabled`` and
``zero_optimization.heterogeneous_offload.cpu_offload``, a ZeRO-1/2 rank whose even shard does not
fit its device keeps its optimizer state on the host while the rank with room keeps its own on
the device. Both train exactly as one process on the global batch, and both issue the same
collectives (upstream's offloaded path reduces the gradient norm as a [1]-tensor where the device
path reduces a 0-d one, forces contiguous gradients on the offloading rank alone, and ZeRO-1 + bf16
chooses another optimizer there; the fork aligns all three). Each alignment is needed: without
either of the first two the ranks hang in mismatched collectives until the group times out;
without the norm's shape the comparison of the sequences fails.

Memory is emulated by accounting (``emulation.mode: dilation``): on the CPU accelerator the host
and the "device" are the same RAM, so a memory cgroup cannot tell them apart."""

import os

import pytest
import torch

from deepspeed.runtime.heterogeneous.measure.collective_log import assert_same_collectives
from harness import run_subcases, run_ranks

SIZES = [5, 3]


def _peak(model, stage, offloaded, bf16=False, torch_adam=True, share=0.5, contiguous_gradients=True):
    """Rank 1's predicted peak (``memory/peak.py``) on its emulated device for ``model`` under the
    tests' configs: upstream's default buckets (the model is smaller than any), ``overlap_comm`` as
    upstream resolves it, an emulated device apart from the host (accounting: ``mode: dilation``).
    The capacities below are built from it: what the pool must decide is the subject, not the bytes."""
    from deepspeed.runtime.heterogeneous.memory.peak import ZeroAllocations, predict_peak
    numels = [p.numel() for p in model.parameters()]
    allocations = ZeroAllocations(num_parameters=sum(numels), largest_parameter=max(numels), zero_stage=stage,
                                  world=2, param_bytes=2 if bf16 else 4, master_bytes=4 if bf16 else 0,
                                  optimizer_temporaries=2 if torch_adam else 0, overlap_comm=stage == 3,
                                  contiguous_gradients=contiguous_gradients,
                                  sub_group_size=1, foreach=True, host_is_device=False)
    return predict_peak(allocations, share=share, offloaded=offloaded).peak_bytes


def _memory_gb(stage, bf16, zero=None):
    """Rank 0 with plenty of room; rank 1 with room for its shard only once its optimizer state
    (and the fp32 master copy under bf16) is on the host (``zero``: the case's settings)."""
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from test_exactness import make_model

    contiguous = (zero or {}).get("contiguous_gradients", True)
    offloaded, even = (_peak(make_model(), stage, fraction, bf16, contiguous_gradients=contiguous)
                       for fraction in (1.0, 0.0))
    # Below the even shard, with most of what offloading frees left for the activations (~2.5 KiB).
    return [1.0, (offloaded + 0.9 * (even - offloaded)) / BYTES_PER_GB]


def _config(stage, gas, clipping, bf16=False, reverse=False, zero=None):
    from test_exactness import ds_config

    memory = _memory_gb(stage, bf16, zero)
    config = ds_config(stage, gas, SIZES, clipping)
    config["heterogeneous_config"]["emulation"] = {"memory_gb": memory[::-1] if reverse else memory,
                                                   "mode": "dilation"}
    config["heterogeneous_memory"] = {"enabled": True, "zero_partitions": "even", "hbm_utilization_threshold": 1.0}
    config["zero_optimization"]["heterogeneous_offload"] = {"cpu_offload": True}
    return config


def _train(rank, world_size, stage, gas, clipping, bf16=False, zero=None):
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    from test_exactness import make_model, train_slices

    config = _config(stage, gas, clipping, bf16, zero=zero)
    config["zero_optimization"].update(zero or {})
    if bf16:
        # fp32 accumulation: the combination where upstream runs ZeRO-1 on BF16_Optimizer
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    model = make_model()
    with recording() as entries:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        train_slices(engine, rank, SIZES, gas, config["train_batch_size"], torch.bfloat16 if bf16 else None)
    state = engine._config.heterogeneous
    return {"params": [p.detach().float().clone() for p in engine.module.parameters()],
            "entries": list(entries), "offloaded": list(state.offloaded_ranks),
            "cpu_offload": bool(engine.optimizer.cpu_offload), "optimizer": type(engine.optimizer).__name__,
            "placement": [r.optimizer_location for r in state.memory_pool.placement.ranks]}


CASES = [
    dict(stage=1, gas=1, clipping=0.0),
    dict(stage=1, gas=2, clipping=0.05),
    dict(stage=2, gas=1, clipping=0.05),
    dict(stage=2, gas=2, clipping=0.0),
    # Upstream turns contiguous gradients on for an offloading rank alone: bucketed reductions there,
    # per-tensor ones on the other rank (a hang). The fork turns them on for every rank.
    dict(stage=2, gas=1, clipping=0.0, zero={"contiguous_gradients": False, "use_multi_rank_bucket_allreduce": False}),
]


@pytest.mark.multiprocess
def test_the_rank_without_room_offloads_and_both_train_exactly_with_the_same_collectives():
    from test_exactness import reference_parameters

    bf16_case = dict(stage=1, gas=1, clipping=0.0, bf16=True)
    results = run_subcases(_train, CASES + [bf16_case], world_size=2, timeout=300)
    for case, (first, second) in zip(CASES + [bf16_case], results):
        assert first["offloaded"] == second["offloaded"] == [1], case
        assert (first["cpu_offload"], second["cpu_offload"]) == (False, True), case
        assert first["placement"] == ["device", "host"], (case, first["placement"])
        # ZeRO-1 + bf16 would take BF16_Optimizer on the rank without offload: one class on both.
        assert first["optimizer"] == second["optimizer"] == "DeepSpeedZeroOptimizer", case
        assert_same_collectives([first["entries"], second["entries"]], what=str(case))
        if case.get("bf16"):
            continue  # bf16 Adam's rounding is not compared with the fp32 reference
        expected = reference_parameters(sum(SIZES) * case["gas"], case["clipping"])
        for result in (first, second):
            for got, want in zip(result["params"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


# -- ZeRO-3: a per-rank ratio over sub-groups -------------------------------------------------------


ZERO3_THRESHOLD = 0.9


def _zero3_memory_gb(wanted):
    """Rank 0 with plenty of room; rank 1 with a budget (``ZERO3_THRESHOLD`` of its capacity) for
    its ZeRO-3 shard once ``wanted`` of its optimizer state (moments and fp32 master copy) is off
    the device (3% wanted, more than the last sub-group's 1.5%: the last two go, 49%). The 10% the
    threshold keeps back holds the ~3.6 KiB the runtime counts for rank 1's activations (the saved
    tensors and the largest one's gradient in flight), as it would a user's."""
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from test_exactness import make_model

    return [1.0, _peak(make_model(), 3, wanted, torch_adam=False) / ZERO3_THRESHOLD / BYTES_PER_GB]


def _train_zero3(rank, world_size, optimizer, gas, clipping):
    """ZeRO-3 on 2 ranks, four sub-groups (one per parameter: sub_group_size 1), rank 1 short of
    3% of its optimizer state. ``optimizer`` "cpu_adam": the client's DeepSpeedCPUAdam, so rank 1
    may offload part of its sub-groups; "torch_adam": the config's torch Adam, which upstream's
    partial offload cannot drive, so rank 1 offloads all of them."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    from test_exactness import LR, ds_config, make_model, train_slices

    config = ds_config(3, gas, SIZES, clipping)
    config["heterogeneous_config"]["emulation"] = {"memory_gb": _zero3_memory_gb(0.03), "mode": "dilation"}
    # Even shares: a rank that does not fit offloads (with "auto" its share would follow its memory).
    config["heterogeneous_memory"] = {"enabled": True, "hbm_utilization_threshold": ZERO3_THRESHOLD,
                                      "zero_partitions": "even"}
    config["zero_optimization"].update(sub_group_size=1, heterogeneous_offload={"cpu_offload": True})
    model = make_model()
    client = None
    if optimizer == "cpu_adam":
        del config["optimizer"]
        client = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0)
    with recording() as entries:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                               config=config)
        train_slices(engine, rank, SIZES, gas, config["train_batch_size"])
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
    state = engine._config.heterogeneous
    placement = state.memory_pool.placement.ranks
    opt = engine.optimizer
    return {"params": params, "entries": list(entries), "offloaded": list(state.offloaded_ranks),
            "ratios": list(state.offload_ratios), "sub_groups": len(opt.fp16_groups),
            "offload": (bool(opt.offload_optimizer), float(getattr(opt, "partial_offload", 0.0))),
            "placed": [(r.offload_fraction, r.offload_sub_groups) for r in placement],
            "optimizer": type(opt.optimizer).__name__}


ZERO3_CASES = [
    dict(optimizer="cpu_adam", gas=1, clipping=0.05),
    dict(optimizer="cpu_adam", gas=2, clipping=0.0),
    dict(optimizer="torch_adam", gas=1, clipping=0.05),
]


@pytest.mark.multiprocess
def test_zero3_rank_without_room_offloads_whole_sub_groups_and_both_train_exactly_with_the_same_collectives():
    from test_exactness import make_model, reference_parameters

    parts = [-(-p.numel() // 2) for p in make_model().parameters()]
    last_two = (parts[2] + parts[3]) / sum(parts)  # the last two sub-groups: upstream offloads from the end
    results = run_subcases(_train_zero3, ZERO3_CASES, world_size=2, timeout=600)
    for case, (first, second) in zip(ZERO3_CASES, results):
        partial = case["optimizer"] == "cpu_adam"
        assert first["offloaded"] == second["offloaded"] == [1], case
        assert first["sub_groups"] == second["sub_groups"] == 4, case  # the pool counts them as upstream forms them
        if partial:  # 3% wanted: the last two sub-groups (the last alone is a bias, 1.5%)
            assert second["placed"][1] == (pytest.approx(last_two), 2), (case, second["placed"])
            assert first["ratios"] == second["ratios"] == [0.0, 0.375], case
            assert second["offload"] == (True, 0.375), case
        else:  # upstream's partial offload needs DeepSpeedCPUAdam: all of rank 1's state goes
            assert second["placed"][1] == (1.0, 4), (case, second["placed"])
            assert first["ratios"] == second["ratios"] == [0.0, 1.0], case
            assert second["offload"] == (True, 1.0), case
        assert first["offload"][0] is False and first["placed"][0] == (0.0, 0), case
        assert_same_collectives([first["entries"], second["entries"]], what=str(case))
        expected = reference_parameters(sum(SIZES) * case["gas"], case["clipping"])
        for result in (first, second):
            for got, want in zip(result["params"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


# -- ZeRO-3 twin-flow (offload_optimizer.ratio) through a checkpoint -----------------------------------


def _twin_flow(rank, world_size, mode, folder, ratio=0.5):
    """ZeRO-3 with ``offload_optimizer: {device: cpu, ratio}`` over four sub-groups on every rank: at
    0.5 the first two are stepped by upstream's ``backup_optimizer`` (torch's AdamW), the last two by
    DeepSpeedCPUAdam; at 1.0 all by DeepSpeedCPUAdam. ``mode``: "through" (steps 1-5), "save" (steps
    1-3, then a checkpoint) or "resume" (that checkpoint, then steps 4-5)."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from test_exactness import LR, ds_config, make_model, train_slices

    config = ds_config(3, 1, SIZES, 0.0)
    del config["optimizer"]
    config["zero_optimization"].update(sub_group_size=1, offload_optimizer={"device": "cpu", "ratio": ratio})
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           optimizer=DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0))
    opt = engine.optimizer
    kept = int((1 - opt.partial_offload) * len(opt.fp16_groups))
    # On a GPU the sub-groups kept on the device map to its name; on the CPU accelerator they map to
    # 'cpu' like the offloaded ones, and upstream steps all of them with DeepSpeedCPUAdam. Name them
    # as a device's, so that backup_optimizer steps them, as on a GPU (its AdamW runs on CPU tensors).
    for index in range(kept):
        opt.subgroup_to_device[index] = "device"
    first = 0
    if mode == "resume":
        engine.load_checkpoint(folder, tag="twin")
        first = SAVE_AT

    def save(steps):
        if mode == "save" and steps == SAVE_AT:
            engine.save_checkpoint(folder, tag="twin")

    train_slices(engine, rank, SIZES, 1, sum(SIZES), first=first, after_step=save)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    backup = getattr(opt, "backup_optimizer", None)
    return {"params": params, "kept": kept, "backup_states": None if backup is None else len(backup.state)}


@pytest.mark.multiprocess
def test_zero3_twin_flow_resumes_with_the_device_sub_groups_moments(tmp_path):
    """Upstream saved only DeepSpeedCPUAdam's state: the backup optimizer's moments of the device
    sub-groups restarted from zero on resume (zero3-twin-flow-checkpoint.patch)."""
    from test_exactness import reference_parameters

    twin, whole = str(tmp_path / "twin"), str(tmp_path / "whole")
    cases = [dict(mode="through", folder=twin), dict(mode="save", folder=twin), dict(mode="resume", folder=twin),
             # Another ratio on resume: the moments go to the optimizer that now steps each sub-group
             # (DeepSpeedCPUAdam counts steps as ints, AdamW as tensors).
             dict(mode="resume", folder=twin, ratio=1.0), dict(mode="save", folder=whole, ratio=1.0),
             dict(mode="resume", folder=whole)]
    through, _, resumed, all_host, _, from_all_host = run_subcases(_twin_flow, cases, world_size=2, timeout=600)
    assert through[0]["kept"] == 2 and through[0]["backup_states"] == 2, through[0]
    assert all_host[0]["kept"] == 0 and all_host[0]["backup_states"] is None, all_host[0]
    assert from_all_host[0]["backup_states"] == 2, from_all_host[0]
    expected = reference_parameters(sum(SIZES), 0.0)
    for result in through:  # twin-flow itself trains as one process would
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for got, want in zip(resumed[0]["params"], through[0]["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=lambda m: f"resumed != uninterrupted: {m}")
    # AdamW and DeepSpeedCPUAdam round alike to ~1e-9 here; lost moments would be off by 1e-2.
    for other in (all_host, from_all_host):
        for got, want in zip(other[0]["params"], through[0]["params"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"other ratio on resume: {m}")


# -- ZeRO-3: a rank on NVMe ------------------------------------------------------------------------

HIDDEN = 32768  # each Linear's partition is 1 MiB of fp32: upstream swaps sub-groups of 1 MiB and more


def _wide_model():
    from test_exactness import WIDTH
    torch.manual_seed(20261202)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))


def _async_io_builds():
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _train_zero3_nvme(rank, world_size, nvme_path):
    """ZeRO-3 on 2 ranks, rank 1 short of half its optimizer state and its node's host budget
    (``cpu_memory_limit``) too small to take it: all of rank 1's optimizer state goes to NVMe."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from test_exactness import LR, ds_config, train_slices

    model = _wide_model()
    config = ds_config(3, 1, SIZES, 0.0)
    del config["optimizer"]
    config["heterogeneous_config"]["emulation"] = {
        "memory_gb": [1.0, _peak(model, 3, 0.5, torch_adam=False) / BYTES_PER_GB], "mode": "dilation"}
    config["heterogeneous_memory"] = {"enabled": True, "hbm_utilization_threshold": 1.0, "cpu_memory_limit": "1MB",
                                      "zero_partitions": "even"}
    config["zero_optimization"].update(sub_group_size=1, heterogeneous_offload={
        "cpu_offload": True, "nvme_offload": True, "nvme_path": nvme_path})
    client = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0)
    with recording() as entries:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                               config=config)
        train_slices(engine, rank, SIZES, 1, config["train_batch_size"])
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
    state = engine._config.heterogeneous
    opt = engine.optimizer
    swapped = opt.swap_optimizer and all(opt._swappable_optimizer_subgroup(i) for i in (0, 2))
    return {"params": params, "entries": list(entries), "nvme": list(state.nvme_ranks),
            "offloaded": list(state.offloaded_ranks), "swapped": bool(swapped),
            "files": sorted(os.listdir(nvme_path)) if os.path.isdir(nvme_path) else [],
            "placed": [(r.optimizer_location, r.offload_fraction) for r in state.memory_pool.placement.ranks]}


@pytest.mark.multiprocess
@pytest.mark.skipif(not _async_io_builds(), reason="DeepSpeed's async-io op needs libaio (apt-get install libaio-dev)")
def test_zero3_rank_placed_on_nvme_swaps_its_optimizer_state_and_both_train_exactly(tmp_path):
    from references import adam_mse_reference
    from test_exactness import LR, global_batches

    nvme_path = str(tmp_path / "nvme")
    first, second = run_ranks(_train_zero3_nvme, world_size=2, timeout=600, args=(nvme_path,))
    assert first["nvme"] == second["nvme"] == [1] and first["offloaded"] == [1], first
    assert first["placed"] == [("device", 0.0), ("nvme", 1.0)], first["placed"]
    # Rank 1 swaps its 1 MiB sub-groups through upstream's optimizer swapper; rank 0 keeps its own.
    assert (first["swapped"], second["swapped"]) == (False, True)
    assert first["files"] == ["zero_stage_3"], first["files"]
    assert_same_collectives([first["entries"], second["entries"]], what="rank 1 on NVMe")
    batches = global_batches(sum(SIZES))
    inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    steps = [list(range(k * sum(SIZES), (k + 1) * sum(SIZES))) for k in range(len(batches))]
    expected = adam_mse_reference(_wide_model(), inputs, targets, steps, LR)
    # 1M parameters: Adam turns summation-order bits of near-zero gradients into parts of an lr-1e-2
    # step (6e-5 in 23 of 524,288 elements); a wrong or stale slice is off by whole steps.
    for result in (first, second):
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=2e-4)


SAVE_AT = 3


def _resume(rank, world_size, stage, folder, load):
    """Steps 1..STEPS (test_exactness) with rank 1 offloaded, saving after step SAVE_AT; or (``load``) the memory of
    the two ranks swapped, so rank 0 offloads, resuming from that checkpoint."""
    import deepspeed
    from test_exactness import make_model, train_slices

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(stage, 1, 0.0, reverse=load))
    first = 0
    if load:
        engine.load_checkpoint(folder, tag="saved")
        first = SAVE_AT

    def save(steps):
        if not load and steps == SAVE_AT:
            engine.save_checkpoint(folder, tag="saved")

    train_slices(engine, rank, SIZES, 1, sum(SIZES), first=first, after_step=save)
    return {"params": [p.detach().clone() for p in engine.module.parameters()],
            "offloaded": list(engine._config.heterogeneous.offloaded_ranks)}


@pytest.mark.multiprocess
def test_saved_with_rank_1_offloaded_resumed_with_rank_0_offloaded_equals_the_uninterrupted_run(tmp_path):
    from test_exactness import reference_parameters

    cases = [dict(stage=stage, folder=str(tmp_path / f"zero{stage}"), load=load) for stage in (1, 2)
             for load in (False, True)]
    results = run_subcases(_resume, cases, world_size=2, timeout=600)
    expected = reference_parameters(sum(SIZES), 0.0)
    for case, per_rank in zip(cases, results):
        offloaded = [0] if case["load"] else [1]
        assert [r["offloaded"] for r in per_rank] == [offloaded, offloaded], case
        for result in per_rank:
            for got, want in zip(result["params"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


def _without_offload(rank, world_size):
    import deepspeed
    from test_exactness import ds_config, make_model

    config = ds_config(1, 1, SIZES, 0.0)
    config["heterogeneous_config"]["emulation"] = {"memory_gb": _memory_gb(1, False), "mode": "dilation"}
    config["heterogeneous_memory"] = {"enabled": True, "zero_partitions": "even", "hbm_utilization_threshold": 1.0}
    model = make_model()
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


@pytest.mark.multiprocess
def test_without_cpu_offload_nothing_moves_and_every_rank_stops_naming_the_key():
    """Rank 1 does not fit without offloading, and offloading is not allowed: every rank stops as
    the engine starts, before DeepSpeed allocates, with the rank, the bytes and the key to set."""
    with pytest.raises(AssertionError) as refused:
        run_ranks(_without_offload, world_size=2, timeout=300)
    message = str(refused.value)
    for rank in (0, 1):
        assert f"rank {rank} raised" in message, message[-3000:]
    assert "MemoryPlacementError" in message and "data-parallel rank 1" in message, message[-3000:]
    assert "zero_optimization.heterogeneous_offload.cpu_offload" in message, message[-3000:]
