# SPDX-License-Identifier: Apache-2.0
"""What the fork starts for an engine ends with it (``engine.destroy()``): built, failed, destroyed
and rebuilt five times in one process, on 2 faked hosts x 2 ranks with the overlap worker on and an
exception raised inside the backward's reductions in the second round, no thread, process group or
/dev/shm file is left beyond what the process held before the first engine, and the last engine
trains as one process does (test_overlap's reference)."""

import glob
import os
import threading

import pytest
import torch

from harness import run_subcases
from test_overlap import STEPS, _config, _data, _model, _reference

ROUNDS, FAIL_ROUND = 5, 1
HOSTS = [0, 0, 1, 1]
SIZES = [2, 2, 2, 2]


def _held():
    from torch.distributed import distributed_c10d
    from deepspeed.utils import groups
    # Upstream clones the world group once per process and keeps it (deepspeed.utils.groups): not the fork's.
    upstream = {groups._WORLD_GROUP} - {None}
    return {"threads": sorted(t.name for t in threading.enumerate()),
            "groups": len([g for g in distributed_c10d._world.pg_map if g not in upstream]),
            # This job's shared-memory buffers (named by its port): other jobs may run beside it.
            "shm": sorted(glob.glob(f"/dev/shm/deepspeed*_{os.environ['MASTER_PORT']}_*"))}


def _rounds(rank, world_size):
    import deepspeed
    from harness import patched_environ
    from deepspeed.runtime.heterogeneous.comm import hierarchical

    before = _held()
    after_destroy, errors, params = [], [], None
    inputs, targets = _data(sum(SIZES))
    offset = sum(SIZES[:rank])
    for round_index in range(ROUNDS):
        with patched_environ({"CROSS_RANK": HOSTS[rank]}):
            model = _model()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(2, SIZES, 1, True))
        reducer = hierarchical.reducer_for(engine.seq_data_parallel_group)
        assert reducer.background is not None and reducer.background.alive
        worker = reducer.background
        if round_index == FAIL_ROUND:
            calls, reduce = [0], reducer.reduce_to_owners

            def failing(tensor, segments):
                calls[0] += 1
                if calls[0] == 2:
                    raise RuntimeError("injected failure inside the backward")
                return reduce(tensor, segments)

            reducer.reduce_to_owners = failing
        try:
            for step in range(STEPS):
                chunk = slice(step * sum(SIZES) + offset, step * sum(SIZES) + offset + SIZES[rank])
                engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
                engine.step()
        except Exception as exc:  # noqa: BLE001 -- the failing round: every rank raises it
            errors.append(f"{type(exc).__name__}: {exc}")
        if round_index == ROUNDS - 1:
            params = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
        assert not worker.alive, "destroy joined the overlap worker"
        assert hierarchical.reducer_for(engine.seq_data_parallel_group) is None
        del engine, model, reducer, worker
        after_destroy.append(_held())
    return {"before": before, "after": after_destroy, "errors": errors, "params": params}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_engine_destroyed_leaves_nothing_and_the_next_one_trains_exactly():
    (per_rank, ) = run_subcases(_rounds, [{}], world_size=4, timeout=480)
    expected = _reference(SIZES, 1)
    for result in per_rank:
        assert result["errors"] == ["OverlapError: deepspeed-hetero: the background gradient reduction failed: "
                                    "injected failure inside the backward"], result["errors"]
        for held in result["after"]:
            assert held == result["before"], (result["before"], result["after"])
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
