# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler: its metrics on hand-made records, and two ranks profiled for real."""

import contextlib
import importlib.util
import io
import json
import os
import sys

import pytest
import torch

from deepspeed.profiling.heterogeneous_profiler import (HeterogeneousProfiler, compute_metrics, draw_timeline,
                                                        format_metrics, health_status, load_metrics, memory_balance,
                                                        merge_replicas, split_collective_time)
from harness import run_ranks

# -- pure metrics ---------------------------------------------------------------------------------


def record(step, compute, optimizer, collective, wall, samples=8, activations=1000):
    return {"step": step, "micro_batch_size": samples, "samples": samples, "compute_s": compute,
            "optimizer_s": optimizer, "collective_s": collective, "wall_s": wall, "activation_bytes": activations}


def two_ranks():
    """Rank 1 is slow: rank 0 computes a quarter of each step and waits for it in collectives."""
    fast = [record(1, 0.20, 0.05, 0.70, 1.0), record(2, 0.20, 0.05, 0.60, 0.9)]
    slow = [record(1, 0.80, 0.10, 0.05, 1.0), record(2, 0.70, 0.10, 0.05, 0.95, samples=6)]
    return [{"records": fast, "peak_bytes": 900}, {"records": slow, "peak_bytes": 1000}]


def test_utilisation_is_busy_over_the_slowest_rank_step_time():
    metrics = compute_metrics(two_ranks())
    total = 1.0 + 0.95  # per step, the slowest rank's wall time
    assert metrics["step_time_s"] == [1.0, 0.95]
    fast, slow = metrics["ranks"]
    assert fast["compute_utilization"] == pytest.approx(0.5 / total)
    assert slow["compute_utilization"] == pytest.approx(1.7 / total)
    assert metrics["heterogeneous_utilization"] == pytest.approx((0.5 + 1.7) / (2 * total))
    assert metrics["samples_per_s"] == pytest.approx((8 + 8 + 8 + 6) / total)
    assert fast["samples_per_step"] == 8 and slow["samples_per_step"] == 7


def test_the_last_rank_to_arrive_sets_the_transfer_and_the_others_waited():
    transfer, waiting = split_collective_time([0.7, 0.05, 0.3])
    assert transfer == 0.05 and waiting == pytest.approx([0.65, 0.0, 0.25])
    fast, slow = compute_metrics(two_ranks())["ranks"]
    total = 1.95
    assert fast["transfer_share"] == slow["transfer_share"] == pytest.approx(0.1 / total)
    assert fast["waiting_share"] == pytest.approx((0.65 + 0.55) / total)
    assert slow["waiting_share"] == 0
    assert fast["communication_share"] == pytest.approx(1.3 / total)
    assert [entry["waiting_s"] for entry in fast["timeline"]] == pytest.approx([0.65, 0.55])


def test_each_step_has_its_communication_share_and_the_window_share_is_their_time_weighted_mean():
    metrics = compute_metrics(two_ranks())
    # Step 1: transfer 0.05, waits 0.65 and 0, step 1.0; step 2: 0.05, 0.55 and 0, step 0.95.
    assert metrics["step_communication_share"] == pytest.approx([(0.05 + 0.65 / 2) / 1.0,
                                                                 (0.05 + 0.55 / 2) / 0.95])
    weighted = sum(share * time for share, time in zip(metrics["step_communication_share"], metrics["step_time_s"]))
    assert metrics["communication_share"] == pytest.approx(weighted / sum(metrics["step_time_s"]))
    assert "communication share per step: min 34.2%, median 37.5%, max 37.5%, 2 of 2 step(s) at 25% or more" in \
        format_metrics(metrics)


def test_memory_balance_of_peaks_or_of_utilisations():
    assert memory_balance([900, 1000]) == pytest.approx(0.9)
    # Equal peaks on devices of different sizes: the small one is fuller.
    assert memory_balance([1000, 1000], [2000, 4000]) == pytest.approx(0.5)
    # One capacity unknown: the peaks are compared.
    assert memory_balance([1000, 1000], [2000, None]) == 1.0
    assert memory_balance([None, 1000]) is None
    metrics = compute_metrics(two_ranks(), capacities=[1000, 4000])
    assert [r["memory_utilization"] for r in metrics["ranks"]] == pytest.approx([0.9, 0.25])
    assert metrics["memory_balance"] == pytest.approx(0.25 / 0.9)
    assert compute_metrics(two_ranks())["ranks"][0]["memory_utilization"] is None  # capacity unknown


def test_health_flags_against_the_seed_targets():
    assert health_status("utilization", 0.76) == "ok" and health_status("utilization", 0.75) == "LOW"
    assert health_status("communication_share", 0.24) == "ok"
    assert health_status("communication_share", 0.25) == "HIGH"
    assert health_status("memory_balance", 0.81) == "ok" and health_status("memory_balance", 0.5) == "LOW"
    assert health_status("memory_balance", None) == "n/a"
    metrics = compute_metrics(two_ranks())
    # (0.5 + 1.7) / (2 * 1.95) busy, (1.3 + 0.1) / (2 * 1.95) in collectives, peaks 900 and 1000.
    assert metrics["health"] == {"utilization": "LOW", "communication_share": "HIGH", "memory_balance": "ok"}
    assert metrics["ranks"][0]["health"] == {"utilization": "LOW", "communication_share": "HIGH"}
    assert metrics["ranks"][1]["health"] == {"utilization": "ok", "communication_share": "ok"}
    text = format_metrics(metrics)
    assert "health targets" in text and "LOW" in text and "HIGH" in text
    assert "memory balance" in text and "> 0.8" in text and "< 25%" in text and "> 75%" in text


def test_model_parallel_members_count_at_the_slowest():
    member = {"dp_rank": 0, "records": [record(1, 0.2, 0.1, 0.3, 1.0, activations=50)], "peak_bytes": 10}
    other = {"dp_rank": 0, "records": [record(1, 0.4, 0.05, 0.2, 1.1, activations=70)], "peak_bytes": 30}
    lonely = {"dp_rank": 1, "records": [record(1, 0.5, 0.1, 0.1, 1.0)], "peak_bytes": None}
    merged = merge_replicas([member, lonely, other], 2)
    assert merged[0]["peak_bytes"] == 30 and merged[1]["peak_bytes"] is None
    first = merged[0]["records"][0]
    assert (first["compute_s"], first["optimizer_s"], first["wall_s"]) == (0.4, 0.1, 1.1)
    assert first["activation_bytes"] == 70
    with pytest.raises(ValueError, match="data-parallel rank 1"):
        merge_replicas([member], 3)


def test_ranks_that_recorded_different_steps_or_none_are_refused():
    ranks = two_ranks()
    ranks[1]["records"] = ranks[1]["records"][1:]
    with pytest.raises(ValueError, match="same step"):
        compute_metrics(ranks)
    with pytest.raises(ValueError, match="at least one step"):
        compute_metrics([{"records": [], "peak_bytes": None}])


def test_metrics_survive_a_json_round_trip(tmp_path):
    plan = {"micro_batch_sizes": [10, 6], "gradient_accumulation_steps": [1, 1], "train_batch_size": 16,
            "strategy": "compute_aware", "predicted_rank_times": [0.5, 0.5], "notes": []}
    event = {"step": 2, "old_sizes": [8, 8], "new_sizes": [10, 6], "predicted_gain": 0.2, "step_time_before": 1.0,
             "step_time_after": None, "observed_gain": None}
    topology = {"hosts": [0, 1], "leader_bandwidths": [None, 2.4e7], "source": "CROSS_RANK",
                "describe": "2 hosts (ranks 0 | 1), inter-host 192 Mbit/s measured"}
    metrics = compute_metrics(two_ranks(), capacities=[2000, None], plan=plan, device_names=["big", "small"],
                              events=[event], topology=topology)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(metrics))
    loaded = load_metrics(path)
    assert loaded == metrics
    text = format_metrics(loaded)
    assert "plan in force" in text and "big" in text and "step 2: micro-batches [8, 8] -> [10, 6]" in text
    assert "topology: 2 hosts (ranks 0 | 1), inter-host 192 Mbit/s measured" in text
    assert "topology" not in format_metrics(compute_metrics(two_ranks()))  # one host: no line


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    event = {"step": 1, "old_sizes": [8, 8], "new_sizes": [10, 6], "predicted_gain": 0.2, "step_time_before": 1.0,
             "step_time_after": 0.8, "observed_gain": 0.2}
    path = draw_timeline(compute_metrics(two_ranks(), events=[event]), str(tmp_path / "timeline.png"))
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def block_matplotlib(monkeypatch):
    """Make matplotlib unimportable, as if it were not installed (cached submodules included)."""
    for name in [name for name in sys.modules if name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_timeline_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    block_matplotlib(monkeypatch)
    metrics = compute_metrics(two_ranks())
    with pytest.raises(ImportError, match="pip install matplotlib"):
        draw_timeline(metrics, str(tmp_path / "timeline.png"))
    assert not (tmp_path / "timeline.png").exists()
    assert "health targets" in format_metrics(metrics)  # the rest works without it


def test_a_module_without_an_engine_says_what_to_pass():
    with pytest.raises(ValueError, match=r"pass the engine that deepspeed.initialize\(\) returned"):
        HeterogeneousProfiler(torch.nn.Linear(2, 2))


# -- two ranks, one emulated at half speed ----------------------------------------------------------

WIDTH = 64
PROFILE_STEPS = 2
PROFILED_STEPS = 6


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.Tanh(), torch.nn.Linear(256, WIDTH))


def dataset(size):
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(size, WIDTH, generator=generator),
                                          torch.randn(size, WIDTH, generator=generator))


def config():
    return {"train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                     "profile_steps": PROFILE_STEPS,
                                     "emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}}}


def profile_training(rank, world_size, out_dir):
    import deepspeed

    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(),
                                                training_data=dataset(16 * (PROFILE_STEPS + PROFILED_STEPS)))
    batches = iter(loader)

    def train(steps):
        for _ in range(steps):
            inputs, targets = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()

    train(PROFILE_STEPS)  # the planner's own profiling: the plan is settled afterwards
    profiler = HeterogeneousProfiler(model)  # the module: the profiler finds its engine
    assert profiler.engine is engine
    profiler.start_heterogeneous_profile()
    train(PROFILED_STEPS)
    profiler.stop_profile()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = profiler.print_heterogeneous_metrics()
    json_path = profiler.export_json(os.path.join(out_dir, f"rank{rank}.json"))
    png = None
    if importlib.util.find_spec("matplotlib") is not None:
        with open(profiler.save_timeline(os.path.join(out_dir, f"rank{rank}.png")), "rb") as handle:
            png = handle.read(8)
    return {"metrics": profiler.get_metrics(), "utilization": profiler.get_device_utilization(), "text": text,
            "printed": printed.getvalue(), "loaded": load_metrics(json_path), "png": png,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


@pytest.mark.multiprocess
def test_two_ranks_see_the_same_profile(tmp_path):
    fast, slow = run_ranks(profile_training, world_size=2, timeout=180, args=(str(tmp_path), ))
    metrics = fast["metrics"]
    assert slow["metrics"] == metrics and slow["utilization"] == fast["utilization"]
    assert metrics["steps"] == list(range(PROFILE_STEPS + 1, PROFILE_STEPS + PROFILED_STEPS + 1))
    assert len(fast["utilization"]) == 2 and all(0 < u <= 1 for u in fast["utilization"]), fast["utilization"]
    for rank in metrics["ranks"]:
        # Busy time and time in collectives are disjoint parts of the step.
        assert rank["compute_utilization"] + rank["communication_share"] <= 1 + 1e-6, rank
        assert rank["peak_memory_bytes"] > 0 and rank["memory_utilization"] is None  # CPU: capacity unknown
        # engine.backward() splits the compute span into forward and backward.
        assert rank["forward_s_per_step"] > 0 and rank["backward_s_per_step"] > 0, rank
        assert rank["forward_s_per_step"] + rank["backward_s_per_step"] <= rank["busy_s_per_step"] + 1e-9, rank
    assert 0 < metrics["memory_balance"] <= 1 and metrics["samples_per_s"] > 0
    assert metrics["plan"]["micro_batch_sizes"] == fast["plan"] and sum(fast["plan"]) == 16
    assert fast["loaded"] == metrics
    # Rank 0 printed the report, with a status for each health target; rank 1 printed nothing.
    assert fast["printed"].strip() == fast["text"] and slow["printed"] == ""
    health = fast["text"].split("health targets:")[1].splitlines()
    for name in ("heterogeneous utilisation", "communication share", "memory balance"):
        line = next(line for line in health if name in line)
        assert line.split()[-1] in ("ok", "LOW", "HIGH"), line
    if importlib.util.find_spec("matplotlib") is not None:
        assert fast["png"] == slow["png"] == b"\x89PNG\r\n\x1a\n"
