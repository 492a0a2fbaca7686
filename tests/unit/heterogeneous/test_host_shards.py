# SPDX-License-Identifier: Apache-2.0
"""``communication.zero3_host_shards`` (``comm/host_shards.py``): ZeRO-3 parameter gathers from a
copy each host keeps, refreshed after each step by all-to-alls in chunks.

On real gloo ranks with faked hosts (``CROSS_RANK``): the parameters are bitwise equal to the same
run gathering over every rank and equal one process's Adam on the global batch; no parameter
gather runs on the whole group while training; the shards are refreshed once per step (in several
chunks where a case makes them small); a parameter
written back through ``GatheredParameters`` and a checkpoint loaded into the running engine are
seen by the next forward; every group's collectives are one sequence on each member. The pure
layout is checked without ranks: each host's spans cover every parameter once, and the refresh
moves exactly the elements a host lacks.
"""

import os

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm.host_shard_plan import (exchange_plan, host_shards_decision, host_spans,
                                                                  link_elements)
from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig

from harness import run_subcases
from references import adam_mse_reference

WIDTH = 24
LAYERS = 4
STEPS = 3
LR = 1e-2


def _model(freeze=False):
    torch.manual_seed(20261206)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(WIDTH, 3))  # 75 elements: slices that do not divide evenly
    model = torch.nn.Sequential(*layers)
    if freeze:  # a frozen layer: partitioned and gathered, never stepped
        model[2].requires_grad_(False)
    return model


def _data(train_batch_size):
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(STEPS * train_batch_size, WIDTH, generator=generator),
            torch.randn(STEPS * train_batch_size, 3, generator=generator))


def _config(sizes, gas, shards, precision=None, memory=None, zero=None, autocast=False):
    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0,
                              **(zero or {})},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                                 "communication": {"zero3_host_shards": shards}},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if autocast:  # fp32 partitions gathered in bf16 (torch autocast's communication dtype of Linear weights)
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if memory:
        config["heterogeneous_memory"] = memory
    return config


def _train(rank, hosts, sizes, gas, shards, precision=None, memory=None, zero=None, write_back=False,
           checkpoint=None, freeze=False, autocast=False, offload=False):
    """Train STEPS steps; returns the parameters, this rank's collectives per group, the refresh
    count and the elements this rank's host shards hold."""
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import host_shards
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model(freeze)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(sizes, gas, shards, precision, memory, zero, autocast))
    owner = host_shards.serves(list(engine.module.parameters()))
    assert (owner is not None) == shards, owner
    dtype = next(engine.module.parameters()).dtype
    train_batch_size = sum(sizes) * gas
    inputs, targets = _data(train_batch_size)
    offset = sum(sizes[:rank])

    def step(k):
        for micro in range(gas):
            start = k * train_batch_size + micro * sum(sizes) + offset
            chunk = slice(start, start + sizes[rank])
            outputs = engine(inputs[chunk].to(dtype))
            engine.backward(torch.nn.functional.mse_loss(outputs.float(), targets[chunk]))
            engine.step()

    def probe():
        """A forward after the step: the host shards are fresh when the primaries then change."""
        with torch.no_grad():
            engine(inputs[offset:offset + sizes[rank]].to(dtype))

    with recording() as entries:
        k = 0
        while k < STEPS:
            step(k)
            if write_back and k == 0:  # rank 0 rescales a weight; every rank takes the written-back value
                probe()
                weight = engine.module[0].weight
                with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
                    if rank == 0:
                        weight.data.mul_(0.5)
            if offload and k == 0:  # the host shards follow the bit16 partitions off the device and back
                from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
                engine.offload_states(include=[OffloadStateTypeEnum.lp_params], pin_memory=False)  # the rest: FusedAdam
                engine.reload_states()
            if checkpoint is not None and k == 0:
                engine.save_checkpoint(checkpoint, tag="first")
            if checkpoint is not None and k == 1 and not os.path.exists(os.path.join(checkpoint, "reloaded")):
                # Step 1 was trained; load step 0's state into this engine and train step 1 again.
                probe()
                engine.load_checkpoint(checkpoint, tag="first")
                torch.distributed.barrier()
                if rank == 0:
                    open(os.path.join(checkpoint, "reloaded"), "w").close()
                torch.distributed.barrier()
                continue
            k += 1
    per_group = {}
    for entry in entries:
        tensors = None if entry.op == "all_to_all_single" else entry.tensors  # each rank sends its own amounts
        per_group.setdefault(entry.group, []).append((entry.op, tensors, entry.details))
    result = {"collectives": per_group,
              "shard_dtypes": sorted({str(p.ds_host_shard.dtype) for p in owner.params}) if owner is not None else [],
              "refreshes": owner.refreshes if owner is not None else 0,
              "held": owner.held_elements() if owner is not None else 0}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        result["params"] = [p.detach().float().clone() for p in engine.module.parameters()]
    if offload:  # destroying the engine frees the host shards
        engine.destroy()
        result["served_after_destroy"] = host_shards.serves(list(model.parameters())) is not None
    return result


def _refused(rank, hosts):
    import deepspeed
    from harness import patched_environ

    config = _config([2] * len(hosts), 1, True, zero={"zero_hpz_partition_size": 2})
    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ValueError as exc:
            return str(exc)
    return None


def _case(rank, world_size, hosts, sizes, gas=1, refused=False, checkpoint=None, owners=False, chunk_bytes=None,
          **options):
    from deepspeed.runtime.heterogeneous.comm import host_shards
    if refused:
        return _refused(rank, hosts)
    folders = [None, None] if checkpoint is None else [os.path.join(checkpoint, name) for name in ("on", "off")]
    default = host_shards.REFRESH_CHUNK_BYTES
    if chunk_bytes is not None:  # refresh chunks smaller than a layer's weight: several per gather
        host_shards.REFRESH_CHUNK_BYTES = chunk_bytes
    try:
        return {"on": _train(rank, hosts, sizes, gas, True, checkpoint=folders[0], **options),
                "off": _train(rank, hosts, sizes, gas, False, checkpoint=folders[1], **options)}
    finally:
        host_shards.REFRESH_CHUNK_BYTES = default


def _reference(sizes, gas, freeze=False):
    train_batch_size = sum(sizes) * gas
    inputs, targets = _data(train_batch_size)
    steps = [list(range(k * train_batch_size, (k + 1) * train_batch_size)) for k in range(STEPS)]
    return [p.detach() for p in adam_mse_reference(_model(freeze), inputs, targets, steps, LR)]


def _check_same_per_group(results):
    groups = {}
    for rank, result in enumerate(results):
        for group, sequence in result["collectives"].items():
            assert rank in group, (rank, group)
            groups.setdefault(group, {})[rank] = sequence
    for group, by_rank in groups.items():
        assert sorted(by_rank) == sorted(group), (group, sorted(by_rank))
        for rank, sequence in by_rank.items():
            assert sequence == by_rank[group[0]], (group, rank)


PARAMETER_GATHERS = ("all_gather_into_tensor", "allgather_fn", "all_gather_coalesced")


def _gathers_over(result, world):
    """The parameter gathers (not the fork's small agreements) on a group of ``world`` ranks."""
    return [op for group, sequence in result["collectives"].items() if len(group) == world
            for op, _, _ in sequence if op in PARAMETER_GATHERS]


def _check(cases, results, world):
    numel = sum(p.numel() for p in _model().parameters())
    for case, per_rank in zip(cases, results):
        reference = None
        if case.get("precision") is None and not case.get("write_back") and not case.get("autocast"):
            reference = _reference(case["sizes"], case.get("gas", 1), case.get("freeze", False))
        hosts = case["hosts"]
        for rank, result in enumerate(per_rank):
            on, off = result["on"], result["off"]
            for got, without in zip(on["params"], off["params"]):
                assert torch.equal(got, without), case  # bitwise: the same values, gathered inside the host
            if reference is not None:
                for got, want in zip(on["params"], reference):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
            # One refresh per step (the first before the first forward); a load and a write-back add one each.
            expected = STEPS + (2 if case.get("checkpoint") else 0) + (1 if case.get("write_back") else 0)
            assert on["refreshes"] == expected, (case, on["refreshes"])
            all_to_alls = [op for group, sequence in on["collectives"].items() if len(group) == world
                           for op, _, _ in sequence if op == "all_to_all_single"]
            if case.get("chunk_bytes"):  # refreshed in chunks, each waited for only as far as it is needed
                assert len(all_to_alls) > 2 * expected, (case, len(all_to_alls))
            assert not _gathers_over(on, world), (case, _gathers_over(on, world))  # none over every rank
            assert _gathers_over(off, world), case
            if case.get("offload"):
                assert on["served_after_destroy"] is False, case
            if case.get("autocast"):  # the host shards in the dtype upstream gathers the Linear layers in
                assert on["shard_dtypes"] == ["torch.bfloat16"], (case, on["shard_dtypes"])
            if case.get("owners") and hosts.count(hosts[rank]) == 3:  # one broadcast per owner inside the host
                assert any(op == "broadcast" for group, sequence in on["collectives"].items() if len(group) == 3
                           for op, _, _ in sequence), case
        _check_same_per_group([result["on"] for result in per_rank])
        total = sum(result["on"]["held"] for result in per_rank)
        assert total == numel * len(set(hosts)), (case, total)  # each host holds the model once


CASES = [
    dict(hosts=[0, 0, 1, 1], sizes=[3, 2, 2, 1], gas=2),
    # backward re-gathers (reuse distance 0, no prefetch): they too stay inside the host.
    dict(hosts=[0, 0, 1, 1], sizes=[2, 2, 2, 2], precision="bf16",
         zero={"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}),
    # Chunks smaller than a weight; after the write-back only that weight is stale and refreshed.
    dict(hosts=[0, 0, 1, 1], sizes=[2, 1, 2, 3], write_back=True, chunk_bytes=600),
    dict(hosts=[0, 0, 1, 1], sizes=[1, 2, 3, 2], offload=True),
    # torch autocast: upstream gathers the Linear layers' fp32 partitions in bf16; the host shards keep that
    # dtype (half the refresh's bytes), so a gather returns upstream's bits. Chunks smaller than a weight, and
    # prefetch buckets that cut modules in two: a module waits on chunks of two gathers, in one order on every
    # rank whichever parameter its coordinator waits for first.
    dict(hosts=[0, 0, 1, 1], sizes=[2, 2, 2, 2], autocast=True, chunk_bytes=600,
         zero={"stage3_prefetch_bucket_size": 700}),
    # Three ranks on one host with skewed shares: the in-host gather broadcasts per owner; a frozen layer.
    dict(hosts=[0, 0, 0, 1], sizes=[2, 2, 2, 2], memory={"zero_partitions": [0.6, 0.1, 0.1, 0.2]}, freeze=True,
         owners=True),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_host_shards_train_bitwise_like_flat_gathers_on_even_hosts(tmp_path):
    cases = CASES + [dict(hosts=[0, 0, 1, 1], sizes=[2, 2, 2, 2], checkpoint=str(tmp_path))]
    _check(cases, run_subcases(_case, cases, world_size=4, timeout=480), 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_host_shards_on_uneven_hosts_and_memory_proportional_shards():
    cases = [dict(hosts=[0, 0, 1], sizes=[2, 1, 3], gas=2),
             dict(hosts=[0, 1, 1], sizes=[3, 1, 2], memory={"zero_partitions": [0.5, 0.3, 0.2]})]
    _check(cases, run_subcases(_case, cases, world_size=3, timeout=480), 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_true_with_hpz_is_refused_on_every_rank():
    refused, = run_subcases(_case, [dict(hosts=[0, 0, 1, 1], sizes=[2, 2, 2, 2], refused=True)], world_size=4,
                            timeout=240)
    assert refused == ["heterogeneous_config.communication.zero3_host_shards is true, but zero_hpz_partition_size "
                       "keeps upstream's secondary shards (set it to 1, or this to false); use \"auto\" (host shards "
                       "where they apply) or false"] * 4, refused


def test_spans_cut_a_parameter_in_proportion_and_cover_it_once():
    assert host_spans(10, [1, 1]) == ((0, 5), (5, 5))
    assert host_spans(10, [1, 1, 1]) == ((0, 3), (3, 3), (6, 4))
    assert host_spans(10, [5, 3, 2]) == ((0, 5), (5, 3), (8, 2))
    assert host_spans(3, [1, 1, 1, 1]) == ((0, 0), (0, 1), (1, 1), (2, 1))
    with pytest.raises(ValueError, match="positive sum"):
        host_spans(4, [0, 0])


@pytest.mark.parametrize("host_members, primaries", [
    (((0, 1), (2, 3)), [((0, 3), (3, 3), (6, 3), (9, 3))] * 2),  # equal slices, padding past 10
    (((0, 1), (2, )), [((0, 5), (5, 3), (8, 2))]),  # 2 + 1 hosts, uneven slices
    (((0, ), (1, 2, 3)), [((0, 4), (4, 2), (6, 2), (8, 2)), ((0, 1), (1, 1), (2, 4), (6, 4))]),
])
def test_the_refresh_fills_every_host_span_once_and_moves_only_what_a_host_lacks(host_members, primaries):
    numel = 10
    world = sum(len(m) for m in host_members)
    hosts = [next(h for h, members in enumerate(host_members) if r in members) for r in range(world)]
    spans, pieces = exchange_plan([numel] * len(primaries), primaries, host_members)
    for k, primary in enumerate(primaries):
        for members in host_members:  # each host's spans cover the parameter exactly once
            covered = sorted(spans[k][m] for m in members)
            assert sum(size for _, size in covered) == numel and covered[0][0] == 0
            assert all(a[0] + a[1] == b[0] for a, b in zip(covered, covered[1:]))
        for r in range(world):  # each element of r's span arrives once, from the rank whose slice holds it
            start, size = spans[k][r]
            got = torch.full((size, ), -1)
            for j in range(world):
                for param, source, target, n in pieces[j][r]:
                    if param == k:
                        assert (got[target:target + n] == -1).all()
                        got[target:target + n] = primary[j][0] + source + torch.arange(n)
            assert torch.equal(got, torch.arange(start, start + size)), (k, r)
    # The link carries, for each host, the elements of the other hosts' slices once, and its own once per other host.
    crossing = link_elements(pieces, hosts)
    for h, members in enumerate(host_members):
        own = sum(min(size, numel - start) if start < numel else 0 for primary in primaries
                  for r, (start, size) in enumerate(primary) if r in members)
        other = numel * len(primaries) - own
        assert crossing[h] == other + own * (len(host_members) - 1), (h, crossing)


def test_the_decision_names_why_and_true_where_it_cannot_apply_is_an_error():
    reducer = object()
    assert host_shards_decision("auto", 3, reducer, False, False, False, False) == (True, None)
    assert host_shards_decision(False, 3, reducer, False, False, False, False) == (False, None)
    assert host_shards_decision(True, 2, reducer, False, False, False, False) == (False, None)  # not ZeRO-3
    active, note = host_shards_decision(True, 3, None, False, False, False, False)  # one host: nothing to keep
    assert not active and "hierarchical reduction is not in force" in note
    active, note = host_shards_decision("auto", 3, reducer, False, True, False, False)
    assert not active and "offload_param" in note
    active, note = host_shards_decision("auto", 3, reducer, False, False, False, False, zenflow=True)
    assert not active and "ZenFlow" in note
    with pytest.raises(ValueError, match=r"zero3_host_shards is true, but quantized weights"):
        host_shards_decision(True, 3, reducer, False, False, True, False)
    assert CommunicationConfig().zero3_host_shards == "auto"
    with pytest.raises(ValueError, match="zero3_host_shards"):
        CommunicationConfig(zero3_host_shards="sometimes")
    with pytest.raises(ValueError, match="zero3_host_shards true rides on the hierarchical reduction"):
        CommunicationConfig(zero3_host_shards=True, hierarchical_reduction=False)
    with pytest.raises(ValueError, match="zero3_host_shards True has nothing to act on|zero3_host_shards true has"):
        CommunicationConfig(zero3_host_shards=True, mode="low_communication")


def test_the_memory_pool_counts_each_rank_s_host_shard_and_auto_shares_make_room_for_it():
    from dataclasses import replace
    from deepspeed.runtime.heterogeneous.memory.peak import ZeroAllocations, predict_peak
    from deepspeed.runtime.heterogeneous.memory.pool import HeterogeneousMemoryPool, ModelStateSpec

    spec = ModelStateSpec(num_parameters=100_000_000, zero_stage=3, param_bytes=2, optimizer_bytes=8)
    shares = [0.4, 0.1, 0.25, 0.25]

    def place(spec, partitions, capacities=("80GB", ) * 4):
        pool = HeterogeneousMemoryPool(list(capacities), hosts=[0, 0, 1, 1], hbm_utilization_threshold=1.0)
        return pool.place(spec, partitions, strict=False, cpu_offload=False)

    without, with_shards = place(spec, shares), place(replace(spec, host_shards=True), shares)
    for a, b, fraction in zip(without.ranks, with_shards.ranks, [0.8, 0.2, 0.5, 0.5]):  # share over host's share
        assert b.parameter_bytes - a.parameter_bytes == pytest.approx(100_000_000 * 2 * fraction)
    # Tight devices: the shares chosen without host shards overflow the small rank once it holds one;
    # auto shares that price the host shard fit every rank.
    capacities = [0.95e9, 0.2e9, 0.6e9, 0.55e9]
    naive = [r.share for r in place(spec, "auto", capacities).ranks]
    assert not all(r.fits for r in place(replace(spec, host_shards=True), naive, capacities).ranks)
    assert all(r.fits for r in place(replace(spec, host_shards=True), "auto", capacities).ranks)
    # The peak prediction names it, and the refresh's buffers.
    allocations = ZeroAllocations(num_parameters=1000, largest_parameter=100, zero_stage=3, world=4, param_bytes=2)
    peak = predict_peak(allocations, share=0.25, host_shard=0.5, hosts=2)
    assert peak.phases["forward"]["host shard"] == 1000 * 2 * 0.5
    # The refresh runs in chunks during the forward: a tiny model is in flight whole, a large one a few chunks.
    from deepspeed.runtime.heterogeneous.comm import host_shards
    assert peak.phases["forward"]["refresh buffers"] == 1000 * 2 * (0.25 * 2 + 0.5)
    assert "refresh" not in peak.phases
    large = ZeroAllocations(num_parameters=10**9, largest_parameter=10**6, zero_stage=3, world=4, param_bytes=2)
    in_flight = host_shards.CHUNKS_IN_FLIGHT * (host_shards.REFRESH_CHUNK_BYTES + 10**6 * 2)
    assert predict_peak(large, share=0.25, host_shard=0.5, hosts=2).phases["forward"]["refresh buffers"] == \
        in_flight * (0.25 * 2 + 0.5)
    assert "host shard" not in predict_peak(allocations, share=0.25).phases["forward"]
