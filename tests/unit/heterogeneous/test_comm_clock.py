# SPDX-License-Identifier: Apache-2.0
"""The collective clock costs nothing with the fork off and counts every collective with it on."""

import pytest
import torch

from harness import run_ranks


def _clock_off_then_on(rank, world_size):
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous import comm_clock

    def build(heterogeneous):
        model = torch.nn.Linear(4, 4)
        config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        if heterogeneous:
            config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "uniform"}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def async_all_reduce():
        before = comm_clock.seconds_in_collectives()
        handle = dist.all_reduce(torch.ones(1024), async_op=True)
        wrapped = isinstance(handle, comm_clock.TimedWork)
        handle.wait()
        return wrapped, comm_clock.seconds_in_collectives() - before

    build(heterogeneous=False)
    off = (comm_clock.enabled, *async_all_reduce())
    build(heterogeneous=True)
    on = (comm_clock.enabled, *async_all_reduce())
    return {"off": off, "on": on}


@pytest.mark.multiprocess
def test_clock_is_inert_with_the_fork_off_and_counts_with_it_on():
    for result in run_ranks(_clock_off_then_on, world_size=2, timeout=180):
        assert result["off"] == (False, False, 0.0)  # no wrapper, no time counted
        enabled, wrapped, seconds = result["on"]
        assert enabled and wrapped and seconds > 0.0
