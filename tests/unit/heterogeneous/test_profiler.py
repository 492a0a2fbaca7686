# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler: its metrics on hand-made records, and two ranks profiled for real."""

import contextlib
import importlib.util
import io
import itertools
import json
import os
import sys

import pytest
import torch

from deepspeed.profiling.heterogeneous_metrics import measured_speed_changes, speed_changes
from deepspeed.profiling.heterogeneous_profiler import (HeterogeneousProfiler, compute_metrics, draw_timeline,
                                                        format_metrics, health_status, load_metrics, memory_balance,
                                                        merge_replicas, split_collective_time)
from deepspeed.profiling.heterogeneous_timeline import GAP_LABEL, short_device_name, timeline_figure
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


# -- speed changes and the timeline's marks ------------------------------------------------------------

XEON = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
SLOW_FROM = 5  # rank 1 runs at 0.4 from this step on
EMULATION = {"speeds": [1.0, 1.0], "speed_schedule": [{"step": SLOW_FROM, "speeds": [1.0, 0.4]}]}


def slowdown_ranks(steps=10, rebalance_after=7):
    """Rank 1 computes 2.5x longer per sample from step SLOW_FROM on, rank 0 waits for it; after
    ``rebalance_after`` rank 1 gets 4 samples instead of 8, which evens the ranks out again."""
    fast, slow = [], []
    for step in range(1, steps + 1):
        rebalanced = step > rebalance_after
        samples = (12, 4) if rebalanced else (8, 8)
        per_sample = (0.05, 0.125 if step >= SLOW_FROM else 0.05)
        wobble = 1.0 + 0.04 * (step % 3 - 1)  # a few percent of noise, well below the factor
        busy = [n * t * wobble for n, t in zip(samples, per_sample)]
        wall = max(busy) + 0.06
        fast.append(record(step, busy[0], 0.0, wall - busy[0] - 0.01, wall, samples=samples[0]))
        slow.append(record(step, busy[1], 0.0, wall - busy[1] - 0.01, wall, samples=samples[1]))
    return [{"records": fast, "peak_bytes": 900}, {"records": slow, "peak_bytes": 1000}]


def slowdown_metrics():
    events = [{"step": step, "old_sizes": old, "new_sizes": new, "predicted_gain": 0.3, "step_time_before": 1.0,
               "step_time_after": None, "observed_gain": None}
              for step, old, new in ((7, [8, 8], [12, 4]), (10, [12, 4], [11, 5]))]  # the last at the right edge
    return compute_metrics(slowdown_ranks(), device_names=[XEON, XEON], events=events, emulation=EMULATION)


def test_a_lasting_change_of_seconds_per_sample_is_a_speed_change_and_one_slow_step_is_not():
    ranks = slowdown_ranks()
    steps = list(range(1, 11))
    records = [rank["records"] for rank in ranks]
    (change, ) = measured_speed_changes(steps, records)
    assert change["step"] == SLOW_FROM and change["rank"] == 1
    assert change["factor"] == pytest.approx(2.5, rel=0.1)
    # A rebalance changes the micro-batch size and with it the cost per sample (a micro-step's
    # fixed cost spread over fewer samples): no speed change.
    overhead = [record(step, 0.8 if step <= 4 else 0.5, 0.0, 0.1, 1.0, samples=8 if step <= 4 else 2)
                for step in range(1, 9)]
    assert measured_speed_changes(list(range(1, 9)), [overhead]) == []
    # One step three times as slow (a neighbour's burst) is no change.
    spiky = [dict(r) for r in records[0]]
    spiky[3]["compute_s"] *= 3
    assert measured_speed_changes(steps, [spiky]) == []
    # Two slow steps at the end of the window (a burst cut short) are no change either.
    burst = [record(step, 0.4 if step < 9 else 1.2, 0.0, 0.1, 1.5) for step in range(1, 11)]
    assert measured_speed_changes(list(range(1, 11)), [burst]) == []
    # A speed-up is a change too, the other way.
    (faster, ) = measured_speed_changes(steps[::-1], [records[1][::-1]])
    assert faster["factor"] == pytest.approx(0.4, rel=0.1)


def test_the_asked_and_the_measured_change_are_one_entry():
    ranks = slowdown_ranks()
    steps = list(range(1, 11))
    records = [rank["records"] for rank in ranks]
    (change, ) = speed_changes(steps, records, EMULATION)
    assert (change["step"], change["rank"], change["asked_speeds"]) == (SLOW_FROM, 1, [1.0, 0.4])
    assert change["measured_factor"] == pytest.approx(2.5, rel=0.1)
    # Asked but not seen (the emulation missed it): kept, with nothing measured.
    unseen = speed_changes(steps, [records[0], records[0]], EMULATION)
    assert [(c["rank"], c["asked_speeds"], c["measured_factor"]) for c in unseen] == [(1, [1.0, 0.4], None)]
    # A change outside the window, or lists that are not one speed per rank, are not in it.
    assert speed_changes(steps[6:], [r[6:] for r in records], EMULATION) == []
    assert speed_changes(steps, [records[0], records[0]], {"speeds": [1.0, 1.0, 1.0], "speed_schedule": []}) == []
    text = format_metrics(slowdown_metrics())
    assert f"rank 1 from step {SLOW_FROM}: speed 1 -> 0.4 asked, 2.5x slower measured" in text


def test_short_device_names_keep_the_model_and_the_json_keeps_the_full_name():
    assert short_device_name(XEON) == "CPU (Xeon 8375C)"
    assert short_device_name("AMD EPYC 7R13 48-Core Processor") == "CPU (EPYC 7R13)"
    assert short_device_name("NVIDIA A100-SXM4-80GB") == "A100-SXM4-80GB"
    assert short_device_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert short_device_name("-") == "" and short_device_name(None) == ""
    long = short_device_name("Some Vendor Accelerator Model 9000 Extreme Edition")
    assert len(long) == 18 and long.endswith("\u2026")
    assert slowdown_metrics()["ranks"][0]["device"] == XEON


def _texts_by_gid(figure, gid):
    return [text for text in figure.axes[0].texts if text.get_gid() == gid]


def test_timeline_marks_steps_changes_gaps_and_short_names():
    pytest.importorskip("matplotlib")
    metrics = slowdown_metrics()
    figure = timeline_figure(metrics)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    # Step numbers on the x axis, one tick at each step's start.
    labels = [label.get_text() for label in axes.get_xticklabels()]
    assert labels == [str(step) for step in metrics["steps"]]
    assert list(axes.get_xticks()) == pytest.approx([0.0] + list(itertools.accumulate(metrics["step_time_s"]))[:-1])
    # Each plan change and each speed change is labelled inside the axes, no two labels overlap.
    rebalances, speeds = _texts_by_gid(figure, "rebalance"), _texts_by_gid(figure, "speed-change")
    assert [t.get_text() for t in rebalances] == ["rebalance after step 7: [8, 8] \u2192 [12, 4]",
                                                  "rebalance after step 10: [12, 4] \u2192 [11, 5]"]
    assert [t.get_text() for t in speeds] == [f"rank 1 from step {SLOW_FROM}: speed 1 \u2192 0.4 asked, "
                                              f"2.5\u00d7 slower measured"]
    inside = axes.get_window_extent(renderer)
    boxes = [text.get_window_extent(renderer) for text in rebalances + speeds]
    for text, box in zip(rebalances + speeds, boxes):
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, \
            (text.get_text(), box, inside)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    # The legend says what a white gap is, and names the marks.
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert GAP_LABEL in legend and "plan change (rebalance)" in legend
    assert any(label.startswith("speed change") for label in legend)
    # Short device names on the y axis.
    assert [label.get_text() for label in axes.get_yticklabels()] == ["rank 0 \u00b7 CPU (Xeon 8375C)",
                                                                      "rank 1 \u00b7 CPU (Xeon 8375C)"]


def test_timeline_of_many_steps_labels_every_kth_step():
    pytest.importorskip("matplotlib")
    ranks = [{"records": [record(step, 0.2, 0.05, 0.1, 0.4) for step in range(1, 61)], "peak_bytes": None}]
    figure = timeline_figure(compute_metrics(ranks))
    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == [str(step) for step in range(1, 61, 3)]
    # The unlabelled step starts get a minor tick (matplotlib drops those under a major one).
    starts = {round(0.4 * step, 6) for step in range(60)}
    ticks = [*figure.axes[0].get_xticks(), *figure.axes[0].get_xticks(minor=True)]
    assert {round(tick, 6) for tick in ticks} == starts


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


def test_save_without_matplotlib_writes_the_json_and_says_why_no_timeline(tmp_path, monkeypatch, capsys):
    from deepspeed.profiling import heterogeneous_profiler
    monkeypatch.setattr(heterogeneous_profiler.dist, "get_rank", lambda: 0)
    profiler = HeterogeneousProfiler.__new__(HeterogeneousProfiler)  # a finished profile, no engine
    profiler._snapshot, profiler._metrics = {"ranks": two_ranks()}, None
    block_matplotlib(monkeypatch)
    folder = tmp_path / "out"
    assert profiler.save(str(folder)) == {"json": str(folder / "profile.json"), "timeline": None}
    assert os.listdir(folder) == ["profile.json"]
    assert "pip install matplotlib" in capsys.readouterr().out


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
    saved = profiler.save(os.path.join(out_dir, "hetero_profile"))
    return {"metrics": profiler.get_metrics(), "utilization": profiler.get_device_utilization(), "text": text,
            "printed": printed.getvalue(), "loaded": load_metrics(json_path), "png": png,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes), "saved": saved}


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
    # save(): the folder it names, the same paths on every rank, written once.
    folder = tmp_path / "hetero_profile"
    assert fast["saved"] == slow["saved"] and fast["saved"]["json"] == str(folder / "profile.json")
    assert load_metrics(folder / "profile.json") == metrics
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert sorted(os.listdir(folder)) == ["profile.json"] + (["timeline.png"] if has_matplotlib else [])
    # Emulated speeds without a schedule: no asked change.
    assert all(change["asked_speeds"] is None for change in metrics["speed_changes"])
