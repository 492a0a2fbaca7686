# SPDX-License-Identifier: Apache-2.0
"""``communication.overlap`` (``comm/overlap.py``): ZeRO-1/2's full gradient buckets reduced by a
background thread during the backward. On real gloo ranks with faked hosts (``CROSS_RANK``, as
in test_hierarchical.py): the parameters are bitwise equal to the same run without overlap and
equal one process's Adam on the global batch; the buckets did go to the background; every group's
collectives are the same sequence on each of its members, per thread; a failure in the worker
reaches every rank's main thread as one error; ``true`` where it cannot apply names why.
"""

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm.overlap import overlap_decision
from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig

from harness import check_collectives_per_group, run_subcases
from references import adam_mse_reference

WIDTH = 24
LAYERS = 6
STEPS = 3
LR = 1e-2
BUCKET = 640  # one layer (24 + 576 elements) per bucket: six buckets, three set aside at once


def _model():
    torch.manual_seed(20261205)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _data(train_batch_size):
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(STEPS * train_batch_size, WIDTH, generator=generator),
            torch.randn(STEPS * train_batch_size, WIDTH, generator=generator))


def _config(stage, sizes, gas, overlap, zero=None, memory=None, precision=None, speeds=None):
    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, **(zero or {})},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                                 "communication": {"overlap": overlap}},
    }
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0)  # every parameter sharded
    if memory:
        config["heterogeneous_memory"] = memory
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if speeds:  # time dilation: slower ranks hand their buckets over later
        config["heterogeneous_config"]["emulation"] = {"speeds": speeds, "mode": "dilation"}
    return config


def _train(rank, hosts, stage, sizes, gas, overlap, fail_at=None, memory=None, zero=None, precision=None,
           speeds=None):
    """Train STEPS steps; returns the parameters, this rank's collectives per thread and group, and
    how many buckets went to the background."""
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import hierarchical
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(stage, sizes, gas, overlap, zero=zero, memory=memory,
                                                              precision=precision, speeds=speeds))
    reducer = hierarchical.reducer_for(engine.seq_data_parallel_group)
    background = reducer.background
    assert (background is not None) == overlap, background
    deferred = [0]
    if background is not None:
        original = background.bucket_full

        def counting(optimizer, dtype):
            deferred[0] += 1
            return original(optimizer, dtype)

        background.bucket_full = counting
        if fail_at is not None:
            calls, reduce = [0], reducer.reduce_to_owners

            def failing(tensor, segments):
                calls[0] += 1
                if calls[0] == fail_at:
                    raise RuntimeError("injected link failure")
                return reduce(tensor, segments)

            reducer.reduce_to_owners = failing
    train_batch_size = sum(sizes) * gas
    inputs, targets = _data(train_batch_size)
    offset = sum(sizes[:rank])
    with recording() as entries:
        try:
            for step in range(STEPS):
                for micro in range(gas):
                    start = step * train_batch_size + micro * sum(sizes) + offset
                    chunk = slice(start, start + sizes[rank])
                    outputs = engine(inputs[chunk].to(next(engine.module.parameters()).dtype))
                    engine.backward(torch.nn.functional.mse_loss(outputs.float(), targets[chunk]))
                    engine.step()
        except Exception as exc:  # noqa: BLE001 -- the failure case returns what every rank saw
            if fail_at is None:
                raise
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if fail_at is not None:
                reducer.reduce_to_owners = reduce
    per_group = {}
    for thread, sequence in (("main", list(entries)), ("background", entries.background)):
        for entry in sequence:
            # The leaders' all-to-all sends and receives different amounts on each leader.
            tensors = None if entry.op == "all_to_all_single" else entry.tensors
            per_group.setdefault((thread, entry.group), []).append((entry.op, tensors, entry.details))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    return {"params": params, "collectives": per_group, "deferred": deferred[0]}


def _refused(rank, hosts, zero):
    import deepspeed
    from harness import patched_environ

    config = _config(2, [2] * len(hosts), 1, True, zero=zero)
    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ValueError as exc:
            return str(exc)
    return None


def _case(rank, world_size, hosts, stage, sizes, gas=1, fail_at=None, refused=None, **options):
    if refused is not None:
        return _refused(rank, hosts, refused)
    if fail_at is not None:
        return _train(rank, hosts, stage, sizes, gas, True, fail_at=fail_at)
    return {"on": _train(rank, hosts, stage, sizes, gas, True, **options),
            "off": _train(rank, hosts, stage, sizes, gas, False, **options)}


def _reference(sizes, gas):
    train_batch_size = sum(sizes) * gas
    inputs, targets = _data(train_batch_size)
    steps = [list(range(k * train_batch_size, (k + 1) * train_batch_size)) for k in range(STEPS)]
    return [p.detach() for p in adam_mse_reference(_model(), inputs, targets, steps, LR)]


CASES = [
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[3, 2, 2, 1]),
    # bf16, and time dilation: the slower ranks hand their buckets over later.
    dict(hosts=[0, 0, 1, 1], stage=3, sizes=[2, 2, 2, 2], precision="bf16", speeds=[1.0, 0.5, 1.0, 0.7]),
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], precision="bf16"),  # bucket and gradients in bf16
    # ZeRO-1 reduces during the backward only with overlap_comm (else after it: nothing to overlap).
    dict(hosts=[0, 0, 1, 1], stage=1, sizes=[1, 3, 2, 2], gas=2, zero={"overlap_comm": True}),
    dict(hosts=[0, 0, 1, 1], stage=3, sizes=[2, 3, 1, 2], gas=2),
]

UNEVEN_CASES = [
    dict(hosts=[0, 0, 1], stage=2, sizes=[2, 1, 3], gas=2),
    # ZeRO-3 with memory-proportional shards: the uneven reduce-scatter goes through the reducer too.
    dict(hosts=[0, 1, 1], stage=3, sizes=[3, 1, 2], memory={"zero_partitions": [0.5, 0.3, 0.2]}),
]


def _check(cases, results):
    for case, per_rank in zip(cases, results):
        expected = _reference(case["sizes"], case.get("gas", 1))
        buckets_per_backward = LAYERS - 1  # the last bucket goes in the epilogue, synchronously
        backwards = STEPS * (case.get("gas", 1) if case["stage"] >= 2 else 1)
        for result in per_rank:
            on, off = result["on"], result["off"]
            for got, without in zip(on["params"], off["params"]):
                assert torch.equal(got, without), case  # bitwise: the same reductions, in the background
            if case.get("precision") is None:
                for got, want in zip(on["params"], expected):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
            assert on["deferred"] == buckets_per_backward * backwards and off["deferred"] == 0, (case, on["deferred"])
            assert any(thread == "background" for thread, _ in on["collectives"]), case
            assert not any(thread == "background" for thread, _ in off["collectives"]), case
        check_collectives_per_group([result["on"] for result in per_rank])
        check_collectives_per_group([result["off"] for result in per_rank])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_overlapped_buckets_train_bitwise_like_synchronous_ones_on_even_hosts():
    _check(CASES, run_subcases(_case, CASES, world_size=4, timeout=480))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_overlapped_buckets_train_bitwise_like_synchronous_ones_on_uneven_hosts():
    _check(UNEVEN_CASES, run_subcases(_case, UNEVEN_CASES, world_size=3, timeout=480))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_failure_in_the_background_reaches_every_rank_as_one_error_and_true_where_it_cannot_apply_is_refused():
    """Every rank's worker fails at its second reduction: each main thread raises, none hangs. And
    ``overlap: true`` with ``reduce_scatter: false`` stops every rank with the same message."""
    cases = [dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], fail_at=2),
             dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], refused={"reduce_scatter": False})]
    failed, refused = run_subcases(_case, cases, world_size=4, timeout=240)
    for result in failed:
        assert result["error"] == ("OverlapError: deepspeed-hetero: the background gradient reduction failed: "
                                   "injected link failure"), result
    assert refused == ["heterogeneous_config.communication.overlap is true, but zero_optimization.reduce_scatter "
                       "is false; use \"auto\" (overlap where it applies) or false"] * 4, refused


def test_overlap_takes_auto_true_false_and_defaults_to_auto():
    assert CommunicationConfig().overlap == "auto"
    for value in ("auto", True, False):
        assert CommunicationConfig(overlap=value).overlap == value
    with pytest.raises(ValueError, match="overlap"):
        CommunicationConfig(overlap="sometimes")


def test_the_decision_names_why_and_true_where_it_cannot_apply_is_an_error():
    assert overlap_decision(False, None, None) == (False, None)
    for setting in ("auto", True):  # one host: nothing to overlap, as for hierarchical_reduction true
        active, note = overlap_decision(setting, None, None)
        assert not active and "hierarchical reduction is not in force" in note
    active, note = overlap_decision("auto", object(), object())
    assert not active and "ZeRO-1/2" in note
    with pytest.raises(ValueError, match=r"communication.overlap is true, but it overlaps ZeRO-1/2/3's gradient "
                       r"buckets, and this run uses another optimizer .*use \"auto\" \(overlap where it applies\) "
                       r"or false"):
        overlap_decision(True, object(), object())