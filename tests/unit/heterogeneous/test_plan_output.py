# SPDX-License-Identifier: Apache-2.0
"""The plan a run trains with, and each change of it, reach a default run's output: one block on
rank 0, not an INFO log line that DeepSpeed's default WARNING level hides."""

import types

import pytest

from deepspeed.runtime.heterogeneous import runtime as runtime_module
from deepspeed.runtime.heterogeneous.data.exchange_account import ExchangeAccount
from deepspeed.runtime.heterogeneous.planning.planner import Plan
from deepspeed.runtime.heterogeneous.runtime import HeterogeneousRuntime
from deepspeed.runtime.heterogeneous.state import HeterogeneousState
from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings

START = Plan((4, 4), (1, 1), 8, "compute_aware", (2.0, 4.0), time_unit="")  # priors: no unit
PROFILED = Plan((6, 2), (1, 1), 8, "compute_aware", (3.0, 2.5))


def runtime_on_rank(monkeypatch, rank):
    """A runtime on global rank ``rank`` (data-parallel rank ``rank % 2``: two replicas, model
    parallel beyond), reduced to what logging and switching plans touch: no engine, no group."""
    monkeypatch.setattr(runtime_module, "dist", types.SimpleNamespace(get_rank=lambda: rank))
    runtime = HeterogeneousRuntime.__new__(HeterogeneousRuntime)
    runtime.state = HeterogeneousState(load_heterogeneous_settings({}), plan=START,
                                       devices=[types.SimpleNamespace(name="fast-gpu"),
                                                types.SimpleNamespace(name="slow-gpu")])
    runtime.config = types.SimpleNamespace(heterogeneous=runtime.state)
    runtime.engine = types.SimpleNamespace(micro_steps=0, global_steps=0)
    runtime.rank, runtime.gas_origin = rank % 2, 0
    runtime.feeding = types.SimpleNamespace(samplers=[])
    runtime.exchange = ExchangeAccount()  # no stock loader re-split here
    # apply_plan writes the engine's batch fields; here only the plan in force matters.
    monkeypatch.setattr(runtime_module, "apply_plan", lambda config, plan: setattr(config.heterogeneous, "plan", plan))
    return runtime


def test_rank0_prints_the_start_up_plan_and_each_change_as_one_block(monkeypatch, capsys):
    runtime = runtime_on_rank(monkeypatch, 0)
    runtime.log_plan("plan at start-up", runtime.plan)
    start_up = capsys.readouterr()
    assert start_up.err == ""
    lines = start_up.out.splitlines()
    assert lines[0] == "[deepspeed-hetero] plan at start-up (strategy compute_aware):"
    assert lines[1].split() == ["rank", "device", "mbs", "gas", "samples/step", "pred.", "time", "share"]
    assert lines[2].split()[:3] == ["0", "fast-gpu", "4"] and lines[3].split()[:3] == ["1", "slow-gpu", "4"]
    # Priors compare the ranks only: no time is shown for them (it printed the micro-batch sizes).
    assert lines[2].split()[5] == "-" and lines[3].split()[5] == "-"
    assert lines[4].startswith("strategy compute_aware, train_batch_size 8, predicted step time not measured, "
                               "balance (mean/max rank time) 75.0% by the devices' prior scores"), lines[4]
    assert sum(line.startswith("[deepspeed-hetero]") for line in lines) == 1

    runtime.switch_to(PROFILED, "plan after profiling step 1")
    change = capsys.readouterr().out.splitlines()
    assert change[0] == "[deepspeed-hetero] plan after profiling step 1 (strategy compute_aware):"
    # The start-up plan's times come from priors and compare ranks only: no unit (it printed "4 s").
    assert change[1] == ("  micro-batches [4, 4] -> [6, 2], gas [1, 1] -> [1, 1], predicted step time not measured "
                         "-> 3 s")
    assert change[2].split() == ["rank", "device", "mbs", "gas", "samples/step", "pred.", "time", "(s)", "share"]
    assert change[3].split()[:3] == ["0", "fast-gpu", "6"]
    assert sum(line.startswith("[deepspeed-hetero]") for line in change) == 1
    assert runtime.plan is PROFILED


@pytest.mark.parametrize("rank", [1, 3])
def test_other_ranks_print_nothing(monkeypatch, capsys, rank):
    runtime = runtime_on_rank(monkeypatch, rank)
    runtime.log_plan("plan at start-up", runtime.plan)
    runtime.switch_to(PROFILED, "plan after profiling step 1")
    assert capsys.readouterr() == ("", "")
    assert runtime.plan is PROFILED
