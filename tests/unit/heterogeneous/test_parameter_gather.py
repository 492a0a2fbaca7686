# SPDX-License-Identifier: Apache-2.0
"""``communication.overlap_parameter_gather`` (``comm/parameter_gather.py``): ZeRO-1/2's gather of
the updated parameters runs in the overlap worker during the next forward. The plan moves every
element of every host's block once and says truly when each is current; on real gloo ranks with
faked hosts (``CROSS_RANK``) the parameters are bitwise equal to the gather in the step and to one
process's Adam, modules waited for part of the gather only, a ``state_dict`` right after a step
holds the new values, and each group's collectives are one sequence on all its members.
"""

import itertools
import time

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm.host_groups import group_layout
from deepspeed.runtime.heterogeneous.comm.parameter_gather import GatherPlan
from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig

from harness import check_collectives_per_group, run_subcases
from references import adam_mse_reference, consecutive_batches

WIDTH = 24
LAYERS = 6
STEPS = 3
LR = 1e-2
BUCKET = 640
CHUNK = 64  # elements of a host's block per round: a dozen rounds for this model
SLOW_S = 0.004  # the worker's lag before each job of a gather


def test_a_plan_moves_each_element_of_every_host_block_once_and_knows_when_it_is_current():
    for hosts, sizes in [((0, 0, 1, 1), [[7, 7, 7, 5], [3, 3, 3, 3]]), ((0, 0, 1), [[10, 4, 9]]),
                         ((0, 1, 0, 1), [[6, 6, 6, 6]]), ((0, 1, 1), [[1, 0, 5], [2, 2, 2]])]:
        layout = group_layout(hosts)
        for host, chunk in itertools.product(range(layout.num_hosts), (1, 4, 100)):
            plan = GatherPlan(sizes, layout, host, chunk)
            for group, members in enumerate(sizes):
                moved = {member: [] for member in range(len(members))}
                round_of = {}
                for index in range(plan.rounds):
                    for owner_host in range(layout.num_hosts):
                        for member, start, end in plan.chunk(group, owner_host, index):
                            assert layout.host_of(member) == owner_host
                            moved[member] += range(start, end)
                            round_of.update({(member, e): index for e in range(start, end)})
                for member, numel in enumerate(members):
                    assert moved[member] == list(range(numel)), (hosts, sizes, chunk, group, member)
                # Element by element: current after ``local`` on its own host, else after its round.
                flat = [(m, e) for m, numel in enumerate(members) for e in range(numel)]
                for position, (member, element) in enumerate(flat):
                    want = 0 if layout.host_of(member) == host else 1 + round_of[(member, element)]
                    assert plan.ready_index(group, position, position + 1) == want
                # A range is current when its last-arriving element is.
                for start in range(len(flat)):
                    for end in range(start + 1, len(flat) + 1):
                        want = max(plan.ready_index(group, p, p + 1) for p in range(start, end))
                        assert plan.ready_index(group, start, end) == want
            assert plan.rounds == max(1, -(-max(sum(sum(g[m] for m in ms) for g in sizes)
                                                for ms in layout.host_members) // chunk))


def _model():
    torch.manual_seed(20261206)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS - 1)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, WIDTH))  # nested: hooks on the leaves


def _data(train_batch_size):
    generator = torch.Generator().manual_seed(6)
    return (torch.randn(STEPS * train_batch_size, WIDTH, generator=generator),
            torch.randn(STEPS * train_batch_size, WIDTH, generator=generator))


def _config(stage, sizes, gas, deferred, zero=None, memory=None):
    config = {
        "train_batch_size": sum(sizes) * gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, **(zero or {})},
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                                 "communication": {"overlap": True, "overlap_parameter_gather": deferred}},
    }
    if memory:
        config["heterogeneous_memory"] = memory
    return config


def _slowed(run):
    def slow():
        time.sleep(SLOW_S)
        run()
    return slow


def _train(rank, hosts, stage, sizes, gas, deferred, zero=None, memory=None, reload=False, groups=False,
           moved=False):
    """Train STEPS steps; returns the parameters, the module state after each step, this rank's
    collectives per thread and group, and the forward's waits (job index, jobs) when deferred."""
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import parameter_gather
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    parameter_gather.DEFAULT_CHUNK_ELEMENTS = CHUNK
    with patched_environ({"CROSS_RANK": hosts[rank]}):
        model = _model()
        parameters = model.parameters()
        if groups:  # two parameter groups, as the usual weight-decay split makes
            parameters = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                          {"params": [p for p in model.parameters() if p.dim() == 1]}]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters,
                                               config=_config(stage, sizes, gas, deferred, zero=zero, memory=memory))
    gather = parameter_gather.deferred(engine.optimizer)
    assert (gather is not None) == deferred
    waits = []
    if gather is not None:
        original = parameter_gather._Gather.wait

        def recorded(pending, index):
            waits.append((index, len(pending.jobs), pending.jobs[min(index, len(pending.jobs) - 1)].done.is_set()))
            return original(pending, index)

        parameter_gather._Gather.wait = recorded
        # The worker lags each job, so that forwards, state dicts and loads meet a gather under way.
        submit = gather.background.submit
        gather.background.submit = lambda jobs: submit([setattr(job, "run", _slowed(job.run)) or job for job in jobs])
    train_batch_size = sum(sizes) * gas
    inputs, targets = _data(train_batch_size)
    offset = sum(sizes[:rank])
    states, finished = [], []  # finished: whether the gather was done after each state_dict / load
    try:
        with recording() as entries:
            for step in range(STEPS):
                for micro in range(gas):
                    start = step * train_batch_size + micro * sum(sizes) + offset
                    chunk = slice(start, start + sizes[rank])
                    outputs = engine(inputs[chunk])
                    engine.backward(torch.nn.functional.mse_loss(outputs, targets[chunk]))
                    engine.step()
                if step == 0:  # right after the step: the state_dict waits for the whole gather
                    states.append({k: v.clone() for k, v in engine.module.state_dict().items()})
                    finished.append(gather is None or gather.pending is None)
                if step == 1 and reload:  # a load right after a step must not race the worker's writes
                    engine.module.load_state_dict(states[0])
                    finished.append(gather is None or gather.pending is None)
                if step == 1 and moved:  # offload_states moves the buffers the worker writes: it waits first
                    engine.offload_states()
                    finished.append(gather is None or gather.pending is None)
                    engine.reload_states()
            engine.wait_for_parameters()  # the last step's gather, recorded too
    finally:
        if gather is not None:
            parameter_gather._Gather.wait = original
    per_group = {}
    for thread, sequence in (("main", list(entries)), ("background", entries.background)):
        for entry in sequence:
            tensors = None if entry.op == "all_to_all_single" else entry.tensors
            per_group.setdefault((thread, entry.group), []).append((entry.op, tensors, entry.details))
    params = [p.detach().clone() for p in engine.module.parameters()]
    return {"params": params, "states": states, "collectives": per_group, "waits": waits, "finished": finished}


def _failed_then_rebuilt(rank, hosts, sizes):
    """Every rank's worker fails the third job of the first gather: the next forward raises on every
    rank; an engine built anew on the same model then trains (the failed gather is not met again)."""
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import parameter_gather

    parameter_gather.DEFAULT_CHUNK_ELEMENTS = CHUNK
    model = _model()
    inputs, targets = _data(sum(sizes))
    chunk = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    original = parameter_gather.DeferredGather._round

    def failing(gather, views):
        run = original(gather, views)
        if views is gather._rounds[1]:
            def run():
                raise RuntimeError("injected link failure")
        return run

    with patched_environ({"CROSS_RANK": hosts[rank]}):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(2, sizes, 1, True))
    parameter_gather.DeferredGather._round = failing
    try:
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
        try:
            engine(inputs[chunk])
            error = None
        except Exception as exc:  # noqa: BLE001 -- what every rank saw
            error = f"{type(exc).__name__}: {exc}"
    finally:
        parameter_gather.DeferredGather._round = original
    engine.destroy()  # its gradient hooks off the model
    with patched_environ({"CROSS_RANK": hosts[rank]}):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(2, sizes, 1, True))
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
    engine.wait_for_parameters()
    return {"error": error, "state": len(engine.module.state_dict())}


def _case(rank, world_size, hosts, stage, sizes, gas=1, refused=None, failed=False, **options):
    if failed:
        return _failed_then_rebuilt(rank, hosts, sizes)
    if refused is not None:
        import deepspeed
        from harness import patched_environ
        with patched_environ({"CROSS_RANK": hosts[rank]}):
            model = _model()
            config = _config(stage, sizes, 1, True, zero=refused)
            config["heterogeneous_config"]["communication"]["overlap"] = "auto"
            try:
                deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            except ValueError as exc:
                return str(exc), _overlap_workers_left()
        return None
    return {"on": _train(rank, hosts, stage, sizes, gas, True, **options),
            "off": _train(rank, hosts, stage, sizes, gas, False, **options)}


def _overlap_workers_left():
    """The overlap workers still running a moment after a refusal, and whether a reducer stayed
    registered."""
    import threading
    from deepspeed.runtime.heterogeneous.comm import hierarchical
    workers = [t for t in threading.enumerate() if t.name == "deepspeed-hetero-overlap"]
    for worker in workers:
        worker.join(timeout=10)
    return sum(worker.is_alive() for worker in workers), bool(hierarchical._reducers)


def _reference(sizes, gas):
    """One process's Adam, each step on the global batch."""
    batch = sum(sizes) * gas
    return [p.detach() for p in adam_mse_reference(_model(), *_data(batch), consecutive_batches(batch, STEPS), LR)]


CASES = [
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[3, 2, 2, 1]),
    dict(hosts=[0, 0, 1, 1], stage=1, sizes=[1, 3, 2, 2], gas=2, zero={"overlap_comm": True}),
    # The bit16 parameters loaded back to the first step's: the next forward trains from those.
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], reload=True),
    # Hosts that are not consecutive ranks, and two parameter groups.
    dict(hosts=[0, 1, 0, 1], stage=2, sizes=[1, 2, 3, 2], groups=True),
    # offload_states right after a step moves the buffers the worker writes into: it waits first.
    dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 1, 3, 2], moved=True),
    dict(hosts=[0, 0, 1], stage=2, sizes=[2, 1, 3], memory={"zero_partitions": [0.5, 0.2, 0.3]}),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_gather_during_the_forward_trains_bitwise_like_the_gather_in_the_step():
    even = run_subcases(_case, CASES[:5], world_size=4, timeout=480)
    uneven = run_subcases(_case, CASES[5:], world_size=3, timeout=240)
    for case, per_rank in zip(CASES, even + uneven):
        expected = _reference(case["sizes"], case.get("gas", 1))
        for result in per_rank:
            on, off = result["on"], result["off"]
            for got, without, want in zip(on["params"], off["params"], expected):
                assert torch.equal(got, without), case
                if not case.get("reload"):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
            for key, value in off["states"][0].items():
                assert torch.equal(on["states"][0][key], value), (case, key)
            assert on["finished"] and all(on["finished"]), (case, on["finished"])
            # Every forward after a step waited module by module; some modules only for part of the gather.
            assert on["waits"] and not off["waits"], case
            if not (case.get("reload") or case.get("moved")):  # there a load or a move waited for everything
                assert any(index < jobs - 1 for index, jobs, _ in on["waits"]), (case, on["waits"])
                assert any(not done for _, _, done in on["waits"]), (case, on["waits"])  # a forward did wait
            # The gather moved from the main thread to the worker.
            count = {(name, thread): sum(len(seq) for (t, _), seq in run["collectives"].items() if t == thread)
                     for name, run in (("on", on), ("off", off)) for thread in ("main", "background")}
            assert count["on", "main"] < count["off", "main"], (case, count)
            assert count["on", "background"] > count["off", "background"], (case, count)
        check_collectives_per_group([result["on"] for result in per_rank])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_failed_gather_stops_every_rank_once_and_true_where_it_cannot_apply_is_refused():
    cases = [dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], refused={"reduce_scatter": False}),
             # ZeRO-3: overlap starts its worker before the gather is refused; the worker stops with it.
             dict(hosts=[0, 0, 1, 1], stage=3, sizes=[2, 2, 2, 2], refused={}),
             dict(hosts=[0, 0, 1, 1], stage=2, sizes=[2, 2, 2, 2], failed=True)]
    refused, refused_zero3, failed = run_subcases(_case, cases, world_size=4, timeout=240)
    for result in failed:
        assert result == {"error": "OverlapError: deepspeed-hetero: the background parameter gather failed: "
                                   "injected link failure", "state": 2 * LAYERS}, result
    # The refusal carries overlap's own reason.
    assert refused == [("heterogeneous_config.communication.overlap_parameter_gather is true, but the gradient "
                        "reduction is not overlapped (communication.overlap: zero_optimization.reduce_scatter is "
                        "false), and its worker runs the gather; set it false", (0, False))] * 4, refused
    for message, left in refused_zero3:
        assert "overlap_parameter_gather" in message and left == (0, False), (message, left)


def test_the_setting_is_off_by_default_and_needs_the_overlapped_reduction():
    assert CommunicationConfig().overlap_parameter_gather is False
    assert CommunicationConfig(overlap_parameter_gather=True).overlap_parameter_gather is True
    for conflict in ({"overlap": False}, {"hierarchical_reduction": False}):
        with pytest.raises(ValueError, match="overlap_parameter_gather true runs in the overlapped reduction's worker"):
            CommunicationConfig(overlap_parameter_gather=True, **conflict)
    with pytest.raises(ValueError, match="overlap_parameter_gather"):
        CommunicationConfig(mode="low_communication", overlap_parameter_gather=True)
    for wrong in ("yes", 1, None):  # ("auto" is DeepSpeed's spelling of the default: false)
        with pytest.raises(ValueError, match=f"{wrong!r} is not allowed; use true or false"):
            CommunicationConfig(overlap_parameter_gather=wrong)
