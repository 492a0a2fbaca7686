# SPDX-License-Identifier: Apache-2.0
"""``communication.compress_inter_host: "lossless"`` (``comm/lossless.py``): the coder gives back
every bit (NaN payloads, infinities, signed zeros, subnormals) and shrinks weights and gradients;
on real gloo ranks with faked hosts (``CROSS_RANK``) ZeRO-1/2/3 trained with it are bitwise the
runs without it, the coder really carried what crossed hosts (ZeRO-3's host-shard refresh on every
rank, the leaders' exchanges), and each group's collectives are one sequence on all its members.
"""

import sys

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm import lossless
from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig

from harness import check_collectives_per_group, run_subcases
from references import adam_mse_reference, consecutive_batches

WIDTH = 32
LAYERS = 4
STEPS = 3
LR = 1e-2


def _bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def test_the_coder_gives_back_every_bit_and_shrinks_weights_and_gradients():
    generator = torch.Generator().manual_seed(3)
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for numel in (0, 1, 7, lossless.MIN_CODED_ELEMENTS - 1, lossless.MIN_CODED_ELEMENTS, 5000):
            tensor = (torch.randn(numel, generator=generator) * 0.02).to(dtype)
            tensor[:len(special)] = special[:numel].to(dtype)
            if numel > 20:  # a NaN with a payload of its own
                tensor.view(torch.uint8)[8 * tensor.element_size()] = 0x5A
                tensor.view(torch.uint8)[9 * tensor.element_size() - 1] = 0x7F
            payload = lossless.encode(tensor)
            assert payload.dtype == torch.uint8 and payload.dim() == 1
            decoded = lossless.decode(payload, dtype, numel)
            assert decoded.dtype == dtype and torch.equal(_bits(decoded), _bits(tensor)), (dtype, numel)
    # Non-contiguous input; integer tensors travel raw (one flag byte more).
    matrix = torch.randn(64, 48, generator=generator)
    assert torch.equal(lossless.decode(lossless.encode(matrix.t()), torch.float32, matrix.numel()),
                       matrix.t().reshape(-1))
    integers = torch.arange(1000)
    assert lossless.encode(integers).numel() == integers.numel() * 8 + 1
    assert torch.equal(lossless.decode(lossless.encode(integers), torch.int64, 1000), integers)
    # A 0-d tensor, flags, bytes, and a view into the middle of a larger tensor.
    offset = (torch.randn(3000, generator=generator) * 0.02)[7:2900]
    for tensor in (torch.tensor(1.5), torch.arange(400) % 3 == 0, torch.arange(300, dtype=torch.uint8), offset):
        decoded = lossless.decode(lossless.encode(tensor), tensor.dtype, tensor.numel())
        assert torch.equal(decoded, tensor.reshape(-1)), tensor.dtype
    # What the coder is for: weights and gradients. Random bits do not shrink, and travel raw.
    layer = torch.nn.Linear(256, 256)
    layer(torch.randn(32, 256, generator=generator)).tanh().sum().backward()
    for tensor, most in ((layer.weight.detach(), 0.9), (layer.weight.grad, 0.9),
                         (layer.weight.detach().to(torch.bfloat16), 0.75)):
        ratio = lossless.encode(tensor).numel() / (tensor.numel() * tensor.element_size())
        assert ratio < most, (tensor.dtype, ratio)
    noise = torch.randint(-2**31, 2**31 - 1, (4096, ), generator=generator, dtype=torch.int32).view(torch.float32)
    payload = lossless.encode(noise)
    assert payload.numel() == 4096 * 4 + 1 and payload[-1] == lossless.RAW
    assert torch.equal(_bits(lossless.decode(payload, torch.float32, 4096)), _bits(noise))


def test_a_payload_that_does_not_fit_is_refused():
    tensor = torch.randn(1000) * 0.02
    payload = lossless.encode(tensor)
    assert payload[-1] == lossless.CODED
    with pytest.raises(ValueError, match="does not hold 2000 elements"):
        lossless.decode(payload[:10], torch.float32, 2000)
    with pytest.raises(ValueError, match="decodes to 1000 top bytes, not 1001"):
        lossless.decode(torch.cat([tensor.view(torch.uint8)[:3], payload]), torch.float32, 1001)
    damaged = payload.clone()
    damaged[3000:3010] = 0xFF  # inside the coded top plane
    with pytest.raises(ValueError, match="does not decode"):
        lossless.decode(damaged, torch.float32, 1000)
    with pytest.raises(ValueError, match="for an empty tensor"):
        lossless.decode(payload, torch.float32, 0)


def test_the_setting_names_what_is_allowed():
    assert CommunicationConfig(compress_inter_host="lossless").compress_inter_host == "lossless"
    for wrong in ("zstd", True, "LOSSLESS"):
        with pytest.raises(ValueError, match="is not allowed; use false, \"lossless\" \\(exact\\), \"bf16\" or"):
            CommunicationConfig(compress_inter_host=wrong)
    with pytest.raises(ValueError, match="compress_inter_host 'lossless' compresses the inter-host step"):
        CommunicationConfig(compress_inter_host="lossless", hierarchical_reduction=False)
    with pytest.raises(ValueError, match="compress_inter_host 'lossless'"):
        CommunicationConfig(mode="low_communication", compress_inter_host="lossless")


# -- on ranks -------------------------------------------------------------------------------


def _model():
    torch.manual_seed(20261206)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS - 1)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, WIDTH))


def _data(train_batch_size):
    generator = torch.Generator().manual_seed(8)
    return (torch.randn(STEPS * train_batch_size, WIDTH, generator=generator),
            torch.randn(STEPS * train_batch_size, WIDTH, generator=generator))


def _train(rank, hosts, stage, sizes, gas, coded, zero=None, memory=None, overlap="auto", parameter_gather=False):
    """Train STEPS steps; returns the parameters, the losses, this rank's collectives per thread and
    group, and what the coder was given and made: (input bytes, payload bytes) per call."""
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import hierarchical, host_shards
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                                 "communication": {"compress_inter_host": "lossless" if coded else False,
                                                   "overlap": overlap,
                                                   "overlap_parameter_gather": parameter_gather}},
    }
    if memory:
        config["heterogeneous_memory"] = memory
    calls = []
    encode = lossless.encode

    def recorded(tensor):
        payload = encode(tensor)
        frame, callers = sys._getframe(1), set()
        for _ in range(4):  # what coded it: the host-shard refresh, or the leaders' reduce or gather
            callers.add(frame.f_code.co_name)
            frame = frame.f_back
        kind = ("refresh" if "_start_coded" in callers else "reduce" if "_exchange_owned" in callers else
                "gather" if "all_gather_partitions" in callers else "round" if "gather_round" in callers else
                str(sorted(callers)))
        calls.append((kind, tensor.numel() * tensor.element_size(), payload.numel()))
        return payload

    lossless.encode = recorded
    if parameter_gather:
        from deepspeed.runtime.heterogeneous.comm import parameter_gather as deferred
        deferred.DEFAULT_CHUNK_ELEMENTS = 64  # many rounds (of 4 pieces: below)
    try:
        with patched_environ({"CROSS_RANK": hosts[rank]}):
            model = _model()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        reducer = hierarchical.reducer_for(engine.seq_data_parallel_group)
        assert reducer is not None and reducer.lossless == coded
        if parameter_gather:
            reducer.piece_elements = 16  # every exchange in pieces, as where the link was measured
        shards = any(getattr(p, host_shards.ATTRIBUTE, None) is not None for p in engine.module.parameters())
        assert overlap is not False or reducer.background is None, reducer.background
        train_batch_size = sum(sizes) * gas
        inputs, targets = _data(train_batch_size)
        offset = sum(sizes[:rank])
        losses = []
        with recording() as entries:
            for step in range(STEPS):
                for micro in range(gas):
                    start = step * train_batch_size + micro * sum(sizes) + offset
                    chunk = slice(start, start + sizes[rank])
                    loss = torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk])
                    losses.append(loss.item())
                    engine.backward(loss)
                    engine.step()
            engine.wait_for_parameters()  # a gather deferred to the next forward, recorded to its end
    finally:
        lossless.encode = encode
    per_group = {}
    for thread, sequence in (("main", list(entries)), ("background", entries.background)):
        for entry in sequence:
            per_group.setdefault((thread, entry.group), []).append((entry.op, entry.details))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"params": params, "losses": losses, "collectives": per_group, "calls": calls, "shards": shards,
            "leader": reducer.is_leader}


def _case(rank, world_size, hosts, stage, sizes, gas=1, **options):
    return {"on": _train(rank, hosts, stage, sizes, gas, True, **options),
            "off": _train(rank, hosts, stage, sizes, gas, False, **options)}


def _reference(sizes, gas):
    """One process's Adam, each step on the global batch."""
    batch = sum(sizes) * gas
    return [p.detach() for p in adam_mse_reference(_model(), *_data(batch), consecutive_batches(batch, STEPS), LR)]


CASES = [
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[3, 2, 2, 1]),
    # Unequal partitions: blocks of unequal size between the leaders; gradient accumulation.
    dict(hosts=[0, 0, 1, 1], stage=1, sizes=[1, 3, 2, 2], gas=2, memory={"zero_partitions": [0.4, 0.3, 0.2, 0.1]}),
    dict(hosts=[0, 1, 0, 1], stage=3, sizes=[1, 3, 2, 3], gas=2),
    dict(hosts=[0, 0, 1, 1], stage=3, sizes=[2, 1, 1, 2], overlap=False),  # the leaders' exchange on the main thread
    # The updated partitions' gather in rounds during the next forward.
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 3, 1, 2], gas=2, parameter_gather=True),
    dict(hosts=[0, 1, 1], stage=3, sizes=[3, 1, 2]),
    dict(hosts=[0, 0, 1], stage=2, sizes=[1, 2, 4]),
    dict(hosts=[0, 1, 1], stage=1, sizes=[2, 2, 3], parameter_gather=True,  # unequal blocks per round
         zero={"overlap_comm": True}),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_training_with_the_coder_is_bitwise_training_without_it():
    even = run_subcases(_case, CASES[:5], world_size=4, timeout=420)
    uneven = run_subcases(_case, CASES[5:], world_size=3, timeout=300)
    for case, per_rank in zip(CASES, even + uneven):
        expected = _reference(case["sizes"], case.get("gas", 1))
        for result in per_rank:
            on, off = result["on"], result["off"]
            assert on["losses"] == off["losses"], case
            for got, without, want in zip(on["params"], off["params"], expected):
                assert torch.equal(got, without), case
                # One process's Adam: summation order only (Adam at lr 1e-2 lifts it to about 1e-5).
                torch.testing.assert_close(got, want, rtol=0, atol=5e-5, msg=lambda m: f"{case}: {m}")
            assert not off["calls"], case
            assert on["shards"] == off["shards"] == (case["stage"] == 3), case
            # What crossed hosts went through the coder, and came out smaller: the leaders' gradient
            # exchange, ZeRO-1/2's updated partitions between the leaders, ZeRO-3's refresh on every rank.
            kinds = {kind for kind, _, _ in on["calls"]}
            gather = "round" if case.get("parameter_gather") else "gather"  # in the next forward, or in the step
            want = ({"reduce"} if on["leader"] else set()) | ({"refresh"} if case["stage"] == 3 else
                                                              {gather} if on["leader"] else set())
            assert kinds == want, (case, kinds, want)
            given, made = sum(n for _, n, _ in on["calls"]), sum(n for _, _, n in on["calls"])
            assert not want or made < 0.95 * given, (case, given, made)
        check_collectives_per_group([result["on"] for result in per_rank])
