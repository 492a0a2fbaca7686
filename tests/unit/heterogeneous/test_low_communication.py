# SPDX-License-Identifier: Apache-2.0
"""``communication.mode: "low_communication"`` (``comm/low_communication.py``): each host trains its
own replica, and the hosts meet every ``sync_every`` steps through an outer Nesterov step. Not
exact, so it is checked against its own documented update: on real gloo ranks with faked hosts
(``CROSS_RANK``), the parameters equal a single-process simulation of the hosts (one model and one
torch Adam per host, each on its host's samples, the documented outer step every H steps); with
inner SGD, H = 1, outer lr 1 and no momentum they equal exact data-parallel training on the global
batch (the anchor); between synchronisations only the host groups carry collectives.
"""

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm.low_communication_plan import (host_loss_scales, host_samples,
                                                                         outer_update, weighted_mean)
from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig

from harness import run_subcases

WIDTH = 12
LAYERS = 3
LR = 1e-2


def _model():
    torch.manual_seed(20261206)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _data(steps, train_batch_size):
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(steps * train_batch_size, WIDTH, generator=generator),
            torch.randn(steps * train_batch_size, WIDTH, generator=generator))


def _config(stage, sizes, outer, optimizer="Adam", precision=None, gas=1, clip=0.0):
    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                                 "communication": {"mode": "low_communication", "low_communication": outer}},
    }
    if optimizer == "Adam":
        config["optimizer"] = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    else:  # the client's torch.optim.SGD
        config["zero_allow_untested_optimizer"] = True
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(rank, world_size, hosts, stage, sizes, outer, steps, optimizer="Adam", precision=None, perturb=False, gas=1,
           clip=0.0):
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        if perturb:  # the other ranks start elsewhere: every host must start from global rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1 * rank)
        client = torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "SGD" else None
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                               config=_config(stage, sizes, outer, optimizer, precision, gas, clip))
    inputs, targets = _data(steps, sum(sizes) * gas)
    offset = sum(sizes[:rank])
    dtype = next(engine.module.parameters()).dtype
    with recording() as entries:
        for step in range(steps):
            for micro in range(gas):
                start = (step * gas + micro) * sum(sizes) + offset
                chunk = slice(start, start + sizes[rank])
                outputs = engine(inputs[chunk].to(dtype))
                engine.backward(torch.nn.functional.mse_loss(outputs.float(), targets[chunk]))
                engine.step()
    groups = sorted({tuple(entry.group) for entry in entries})
    from deepspeed.runtime.constants import ROUTE_EVAL
    sampler = engine.deepspeed_io(torch.utils.data.TensorDataset(inputs), route=ROUTE_EVAL).data_sampler
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    masters = None
    if stage:
        from deepspeed.utils import safe_get_full_fp32_param
        masters = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    return {"params": params, "masters": masters, "groups": groups, "syncs": engine.synchronise_replicas(),
            "eval_shard": (sampler.num_replicas, sampler.rank)}


def _simulate(hosts, sizes, outer, steps, optimizer="Adam", gas=1, clip=0.0):
    """One process: a model and an inner optimizer per host, each on its host's samples (the mean
    over them, the host's gradient norm clipped to ``clip``), and the documented outer step every
    ``sync_every`` steps."""
    members = {}
    for rank, host in enumerate(hosts):
        members.setdefault(host, []).append(rank)
    order = sorted(members, key=lambda h: members[h][0])
    replicas = [_model() for _ in order]
    make = (lambda ps: torch.optim.Adam(ps, lr=LR)) if optimizer == "Adam" else (lambda ps: torch.optim.SGD(ps, lr=LR))
    inners = [make(model.parameters()) for model in replicas]
    theta = torch.cat([p.detach().reshape(-1) for p in replicas[0].parameters()]).clone()
    momentum = torch.zeros_like(theta) if outer.get("outer_momentum", 0.5) else None
    inputs, targets = _data(steps, sum(sizes) * gas)
    samples = [0] * len(order)
    for step in range(steps):
        for index, host in enumerate(order):
            firsts = [(step * gas + micro) * sum(sizes) for micro in range(gas)]
            rows = torch.cat([torch.arange(first + sum(sizes[:r]), first + sum(sizes[:r + 1]))
                              for first in firsts for r in members[host]])
            inners[index].zero_grad()
            torch.nn.functional.mse_loss(replicas[index](inputs[rows]), targets[rows]).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(replicas[index].parameters(), clip)
            inners[index].step()
            samples[index] += len(rows)
        if (step + 1) % outer["sync_every"] == 0:
            deltas = [theta - torch.cat([p.detach().reshape(-1) for p in model.parameters()]) for model in replicas]
            if outer.get("pseudo_gradient_dtype") == "bf16":
                deltas = [d.to(torch.bfloat16) for d in deltas]
            mean = weighted_mean(deltas, [s / sum(samples) for s in samples])
            outer_update(theta, momentum, mean, outer.get("outer_lr", 1.0), outer.get("outer_momentum", 0.5))
            for model in replicas:
                torch.nn.utils.vector_to_parameters(theta.clone(), model.parameters())  # not views of theta
            samples = [0] * len(order)
    return {host: [p.detach() for p in replicas[index].parameters()] for index, host in enumerate(order)}


def _case(rank, world_size, **case):
    return _train(rank, world_size, **case)


def _refused(rank, world_size, hosts, stage, precision=None, extra=None):
    """The message every rank raised at ``deepspeed.initialize``."""
    import deepspeed
    from harness import patched_environ

    config = _config(stage, [2] * world_size, OUTER, precision=precision)
    for block, values in (extra or {}).items():
        config.setdefault(block, {}).update(values)
    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except Exception as exc:  # noqa: BLE001 -- the message is the result
            return f"{type(exc).__name__}: {exc}"
    return None


def _resume(rank, world_size, hosts, stage, sizes, outer, steps, save_at, folder):
    """Train ``steps`` steps, saving after ``save_at`` (mid-period); then a new engine loads that
    checkpoint and trains the rest. Returns both runs' parameters and what was written."""
    import os
    import deepspeed
    from harness import patched_environ

    inputs, targets = _data(steps, sum(sizes))
    offset = sum(sizes[:rank])

    def engine_and_steps(first, last, save=False, load=False):
        with patched_environ({"CROSS_RANK": hosts[rank]}):
            model = _model()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(stage, sizes, outer))
        if load:
            engine.load_checkpoint(folder)
        for step in range(first, last):
            start = step * sum(sizes) + offset
            chunk = slice(start, start + sizes[rank])
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
            engine.step()
            if save and step + 1 == save_at:
                engine.save_checkpoint(folder, tag="ckpt")
        return [p.detach().clone() for p in engine.module.parameters()]

    uninterrupted = engine_and_steps(0, steps, save=True)
    resumed = engine_and_steps(save_at, steps, load=True)
    with open(os.path.join(folder, "latest")) as handle:
        latest = handle.read()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "latest": latest,
            "folders": sorted(os.listdir(os.path.join(folder, "ckpt")))}


OUTER = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
OUTER_RESUME = {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
CASES = [
    # Even hosts, ZeRO-2, an uneven plan inside the hosts and between them (host 0: 5 samples, host 1: 3).
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[3, 2, 2, 1], outer=OUTER, steps=7, perturb=True),
    dict(hosts=[0, 0, 1, 1], stage=1, sizes=[2, 2, 3, 1], outer={**OUTER, "pseudo_gradient_dtype": "bf16"}, steps=6),
    dict(hosts=[0, 0, 1, 1], stage=0, sizes=[2, 2, 2, 2], outer={**OUTER, "sync_every": 2}, steps=5),
    # Gradient accumulation, and clipping of each host's gradient norm (over the host's partitions).
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[1, 2, 2, 2], outer=OUTER, steps=4, gas=2, clip=0.05),
]
# bf16 (ZeRO-1's fp32 masters behind bf16 parameters): after the last step's synchronisation every
# rank of both hosts holds the same fp32 masters, and its bf16 parameters are their rounding.
BF16_CASES = [dict(hosts=[0, 0, 1, 1], stage=1, sizes=[3, 2, 2, 1], outer={**OUTER, "sync_every": 2}, steps=4,
                   precision="bf16")]
UNEVEN_CASES = [
    dict(hosts=[0, 0, 1], stage=2, sizes=[2, 1, 3], outer={**OUTER, "sync_every": 2}, steps=5),
    # The anchor: inner SGD, H = 1, outer lr 1, no momentum is exact data-parallel training.
    dict(hosts=[0, 0, 1], stage=2, sizes=[1, 2, 3], outer={"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
         steps=4, optimizer="SGD"),
]


def _check(cases, results):
    for case, per_rank in zip(cases, results):
        expected = _simulate(case["hosts"], case["sizes"], case["outer"], case["steps"], case.get("optimizer", "Adam"),
                             case.get("gas", 1), case.get("clip", 0.0))
        syncs = case["steps"] // case["outer"]["sync_every"]
        for rank, result in enumerate(per_rank):
            want = expected[case["hosts"][rank]]
            for got in (result["params"], result["masters"] or result["params"]):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=0, atol=2e-6, msg=lambda m: f"{case} rank {rank}: {m}")
            # Every step's gradients stay inside the host: the only groups spanning hosts are the
            # world's (the fork's small agreements) and the leaders' (the synchronisations).
            members = [r for r, h in enumerate(case["hosts"]) if h == case["hosts"][rank]]
            leaders = sorted({min(r for r, h in enumerate(case["hosts"]) if h == host) for host in case["hosts"]})
            world = tuple(range(len(case["hosts"])))
            assert set(result["groups"]) <= {tuple(members), tuple(leaders), world}, (case, result["groups"])
            assert result["syncs"] == syncs + (case["steps"] % case["outer"]["sync_every"] > 0)
            assert result["eval_shard"] == (len(case["hosts"]), rank)  # an evaluation loader: one shard per rank
        if case.get("optimizer") == "SGD":  # the anchor: exact data-parallel SGD on the global batch
            model = _model()
            sgd = torch.optim.SGD(model.parameters(), lr=LR)
            inputs, targets = _data(case["steps"], sum(case["sizes"]))
            for step in range(case["steps"]):
                rows = slice(step * sum(case["sizes"]), (step + 1) * sum(case["sizes"]))
                sgd.zero_grad()
                torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
                sgd.step()
            for result in per_rank:
                for g, w in zip(result["params"], model.parameters()):
                    torch.testing.assert_close(g, w.detach(), rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_each_host_trains_a_replica_and_the_outer_step_is_the_documented_one_on_even_hosts():
    _check(CASES, run_subcases(_case, CASES, world_size=4, timeout=480))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_in_bf16_the_replicas_meet_in_their_fp32_masters():
    (per_rank, ) = run_subcases(_case, BF16_CASES, world_size=4, timeout=240)
    first = per_rank[0]["masters"]
    assert not all(torch.equal(a, b) for a, b in zip(first, [p.detach().float() for p in _model().parameters()]))
    for result in per_rank:
        for master, param, reference in zip(result["masters"], result["params"], first):
            assert torch.equal(master, reference)
            assert torch.equal(param, master.to(torch.bfloat16).float())
        assert result["syncs"] == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_uneven_hosts_and_the_exact_anchor():
    _check(UNEVEN_CASES, run_subcases(_case, UNEVEN_CASES, world_size=3, timeout=480))


def test_loss_scales_make_each_host_average_its_own_samples():
    # Plan [3, 2 | 2, 1]: B = 8, W = 4; host 0 has 5 samples on 2 ranks, host 1 has 3 on 2.
    scales = host_loss_scales((3, 2, 2, 1), (0, 0, 1, 1))
    assert scales == pytest.approx((2 * 8 / (4 * 5),) * 2 + (2 * 8 / (4 * 3),) * 2)
    weights = [4 * n / 8 for n in (3, 2, 2, 1)]  # the engine's W * n_i / B
    for host, ranks in ((0, (0, 1)), (1, (2, 3))):
        # The host's reducer averages over its 2 ranks: sum_i w_i s_i n_i-means / 2 = the host mean.
        per_sample = [weights[r] * scales[r] / 2 / (3, 2, 2, 1)[r] for r in ranks]
        assert per_sample == pytest.approx([1 / host_samples((3, 2, 2, 1), (0, 0, 1, 1))[host]] * 2)
    assert host_loss_scales((2, 2, 2, 2), (0, 0, 1, 1)) == (1.0, 1.0, 1.0, 1.0)


def test_the_outer_step_is_nesterov_on_the_weighted_mean():
    theta = torch.tensor([1.0, 2.0])
    momentum = torch.tensor([0.5, -0.5])
    deltas = [torch.tensor([0.2, 0.4]), torch.tensor([-0.2, 0.0])]
    mean = weighted_mean(deltas, [0.75, 0.25])
    torch.testing.assert_close(mean, torch.tensor([0.75 * 0.2 - 0.25 * 0.2, 0.75 * 0.4]))
    outer_update(theta, momentum, mean.clone(), lr=0.5, mu=0.9)
    m = torch.tensor([0.9 * 0.5, 0.9 * -0.5]) + mean
    torch.testing.assert_close(momentum, m)
    torch.testing.assert_close(theta, torch.tensor([1.0, 2.0]) - 0.5 * (mean + 0.9 * m))
    plain = torch.tensor([1.0, 2.0])
    outer_update(plain, None, mean.clone(), lr=1.0, mu=0.0)  # lr 1, no momentum: the weighted average of replicas
    torch.testing.assert_close(plain, torch.tensor([1.0, 2.0]) - mean)


def test_the_settings_name_what_is_wrong():
    assert CommunicationConfig().mode == "exact"
    config = CommunicationConfig(mode="low_communication")
    outer = config.low_communication
    assert (outer.sync_every, outer.outer_lr, outer.outer_momentum, outer.pseudo_gradient_dtype) == (50, 1.0, 0.5, "fp32")
    with pytest.raises(ValueError, match=r"low_communication is set, but mode is \"exact\""):
        CommunicationConfig(low_communication={"sync_every": 10})
    with pytest.raises(ValueError, match=r"overlap true has nothing to act on"):
        CommunicationConfig(mode="low_communication", overlap=True)
    with pytest.raises(ValueError, match=r"compress_inter_host 'bf16' has nothing to act on"):
        CommunicationConfig(mode="low_communication", compress_inter_host="bf16")
    with pytest.raises(ValueError, match="outer_momentum"):
        CommunicationConfig(mode="low_communication", low_communication={"outer_momentum": 1.0})


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_what_it_cannot_cover_stops_every_rank_with_one_named_reason():
    cases = [dict(hosts=[0, 0], stage=2), dict(hosts=[0, 1], stage=3), dict(hosts=[0, 1], stage=0, precision="bf16"),
             dict(hosts=[0, 1], stage=2, extra={"heterogeneous_memory": {"enabled": True}}),
             dict(hosts=[0, 1], stage=2, extra={"heterogeneous_config": {"resplit_fed_batches": True}})]
    one_host, zero3, zero0_bf16, memory, resplit = run_subcases(_refused, cases, world_size=2, timeout=240)
    key = 'HeterogeneousConfigError: heterogeneous_config.communication.mode "low_communication"'
    assert one_host == [f'{key} synchronises hosts, and every rank runs on one host; use mode "exact"'] * 2
    assert zero3 == [f"{key} covers ZeRO stages 0-2 (ZeRO-3 would partition each parameter over its host only); "
                     'use zero_optimization.stage 2, or mode "exact"'] * 2
    assert zero0_bf16 == [f"{key} writes the outer step into the optimizer's fp32 master weights, which ZeRO stage 0 "
                          "in fp16/bf16 does not expose; use zero_optimization.stage 1 or 2"] * 2
    assert memory == [f"{key} splits ZeRO state evenly inside each host; heterogeneous_memory (enabled, or a "
                      "zero_partitions list) plans it over every rank: turn it off"] * 2
    assert all(message.startswith(f"{key} keeps every sample on the host it was fed on") for message in resplit)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_run_saved_between_synchronisations_resumes_bitwise(tmp_path):
    """Saved after step 3 of periods of 2 (one inner step into a period), loaded by new engines:
    the last steps and their synchronisation equal the uninterrupted run's bit for bit; each host
    wrote its replica under <tag>/host<h>."""
    case = dict(hosts=[0, 0, 1], stage=2, sizes=[2, 1, 3], outer=OUTER_RESUME, steps=6, save_at=3,
                folder=str(tmp_path))
    (per_rank, ) = run_subcases(_resume, [case], world_size=3, timeout=240)
    for result in per_rank:
        assert result["folders"] == ["host0", "host1"] and result["latest"] == "ckpt/host0"
        for got, want in zip(result["resumed"], result["uninterrupted"]):
            assert torch.equal(got, want)
