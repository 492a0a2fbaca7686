# SPDX-License-Identifier: Apache-2.0
"""How often profiling's noise gate moves work, with 3 profiling steps and with 5 (the default).

One noisy step can move work between equal ranks: two equal ranks get [12, 4] after profiling when
rank 1's one step at the start-up plan after the warm-up runs 1.44x rank 0's. The gate reads the
ranks' times under the start-up plan with the relative standard error of each rank's level over all
its fitted micro-steps; a single step's own noise is sqrt(n) times larger. This benchmark measures,
per speed ratio, how often the plan after profiling moves work, and on the same recorded
measurements what the stricter reading (one step's noise) would have decided: the two readings side
by side on identical data, the evidence for the gate's reading (docs/benchmarks.md).

Workload: the rebalancing test's MLP (512 -> 2048 -> 512, tanh), ZeRO-1, global batch 16, two
ranks, gas 1, speeds emulated by time dilation; scenarios: equal ranks, rank 1 at 0.4, rank 1 at
0.25; REPEATS runs each. Targets (reported, not asserted): equal ranks move work in at most 1 run
in 4; a rank at 0.4 or 0.25 is detected (work moved to rank 0) in at least 3 runs in 4.

    python tests/perf/bench_profiling_gate.py [--repeats N] [--profile-steps K]   (from the repository root)

``--profile-steps`` (default 3; ``heterogeneous_config.profile_steps`` defaults to 5) writes
``profiling_gate.json`` for 3 and ``profiling_gate_<K>.json`` otherwise.

``--dynamic``: the same workload, emulation and scenarios with
``scheduler: {"dynamic_rebalancing": true, "check_interval": K}`` (the other scheduler keys at their
defaults: imbalance_threshold 0.1, cooldown_checks 1) and ``--checks`` intervals of K steps after
profiling. A start-up plan that profiling keeps within the noise is then no longer final: the
first check measures per-sample models from its own interval (its baseline), later checks may move
work (a predicted gain above the threshold and the noise on two checks in a row), and the check
after a move judges it (reverted when the step got slower). Per run it records the start-up plan,
the plan after profiling and whether profiling kept the start-up plan, the plan after every later
step, every check's decision (the rebalancer's reason), the rebalances and reverts, and rank 0's
``[deepspeed-hetero]`` log lines. Per scenario it reports the runs where work moved after
profiling, the runs where a later check moved work, and the final plans; targets (reported, not
asserted): equal ranks end uneven in at most 1 run in 4 (the gate's own target), a rank at 0.4 or
0.25 ends with work moved to rank 0 in at least 3 runs in 4.

    python tests/perf/bench_profiling_gate.py --dynamic [--repeats N] [--profile-steps P]
        [--check-interval K] [--checks C]

``--check-interval`` defaults to 20 (``scheduler.check_interval``'s default) and ``--checks`` to 4:
the earliest move of a kept plan is at the third check (baseline, then two checks in a row above
the threshold) and the fourth judges it. Writes ``profiling_gate_dynamic.json`` for 3 profiling
steps, interval 20 and 4 checks, else ``profiling_gate_dynamic_p<P>_k<K>_c<C>.json``.
"""

import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

REPEATS = 8
SCENARIOS = {"equal": [1.0, 1.0], "rank 1 at 0.4": [1.0, 0.4], "rank 1 at 0.25": [1.0, 0.25]}
WIDTH, HIDDEN, BATCH = 512, 2048, 16
TARGET_EQUAL_MOVES = 0.25
TARGET_DETECTED = 0.75
RESULTS = REPO / "tests" / "perf" / "results" / "profiling_gate.json"


def _profile(rank, world_size, speeds, profile_steps):
    """``profile_steps`` profiling steps; returns the plan after them and the pooled profiling history."""
    import deepspeed
    import torch

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))
    config = {"train_batch_size": BATCH, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": profile_steps,
                                       "emulation": {"speeds": speeds, "mode": "dilation"}}}
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn((profile_steps + 1) * BATCH, WIDTH, generator=generator),
                                          torch.randn((profile_steps + 1) * BATCH, WIDTH, generator=generator))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    runtime = engine._heterogeneous_runtime()
    startup = engine.heterogeneous_plan.to_dict()
    for _, (inputs, targets) in zip(range(profile_steps), loader):
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    return {"plan": list(engine.heterogeneous_plan.micro_batch_sizes), "history": runtime.decisions.history,
            "startup": startup}


class _Tee:
    """Rank 0's stdout, kept as well as written: the runtime prints its plans and decisions."""

    def __init__(self, stream):
        self.stream, self.lines, self._partial = stream, [], ""

    def write(self, text):
        self.stream.write(text)
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self.lines += done
        return len(text)

    def flush(self):
        self.stream.flush()


def _dynamic(rank, world_size, speeds, profile_steps, check_interval, checks):
    """``profile_steps`` profiling steps, then ``checks`` check intervals of dynamic rebalancing;
    returns the plans (start-up, after profiling, after every later step), every check's decision,
    the rebalance events and rank 0's ``[deepspeed-hetero]`` log lines."""
    import contextlib
    import deepspeed
    import torch

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))
    config = {"train_batch_size": BATCH, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": profile_steps,
                                       "scheduler": {"dynamic_rebalancing": True, "check_interval": check_interval},
                                       "emulation": {"speeds": speeds, "mode": "dilation"}}}
    later = check_interval * checks
    samples = (profile_steps + later + 1) * BATCH
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(samples, WIDTH, generator=generator),
                                          torch.randn(samples, WIDTH, generator=generator))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    runtime = engine._heterogeneous_runtime()
    startup = list(engine.heterogeneous_plan.micro_batch_sizes)
    decisions = []  # rank 0 decides: each check's (and each switch check's) outcome, for the reader

    def recorded(method, kind):
        def call(*args, **kwargs):
            decision = method(*args, **kwargs)
            if decision is not None:
                entry = {"step": engine.global_steps, "kind": kind, "rebalance": decision.rebalance,
                         "revert": decision.revert, "predicted_gain": round(decision.predicted_gain, 4),
                         "reason": decision.reason,
                         "plan": None if decision.plan is None else list(decision.plan.micro_batch_sizes)}
                if kind == "check":  # the interval's median time per micro-step of each rank, in ms
                    entry["median_ms"] = [round(1e3 * statistics.median(times), 3) for times in args[1]]
                decisions.append(entry)
            return decision
        return call

    rebalancer = runtime.decisions.rebalancer
    rebalancer.check = recorded(rebalancer.check, "check")
    rebalancer.judge_switch = recorded(rebalancer.judge_switch, "switch check")
    tee = _Tee(sys.stdout)
    plans = []
    with contextlib.redirect_stdout(tee) if rank == 0 else contextlib.nullcontext():
        for _, (inputs, targets) in zip(range(profile_steps + later), loader):
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
            plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
    after_profiling = plans[profile_steps - 1]
    events = [{"step": e.step, "kind": e.kind, "old": list(e.old_sizes), "new": list(e.new_sizes),
               "predicted_gain": round(e.predicted_gain, 4),
               "observed_gain": None if e.observed_gain is None else round(e.observed_gain, 4)}
              for e in runtime.decisions.events]
    return {"startup": startup, "after_profiling": after_profiling, "kept": after_profiling == startup,
            "later_plans": plans[profile_steps:], "final": plans[-1], "events": events,
            "later_moved": bool(events), "checks": decisions,
            "log": [line for line in tee.lines if line.startswith("[deepspeed-hetero]")],
            "history": runtime.decisions.history}


def _dynamic_main(repeats, steps):
    interval = int(sys.argv[sys.argv.index("--check-interval") + 1]) if "--check-interval" in sys.argv else 20
    checks = int(sys.argv[sys.argv.index("--checks") + 1]) if "--checks" in sys.argv else 4
    if steps < 1:
        raise SystemExit("--dynamic needs --profile-steps 1 or more: it reports what follows profiling's plan")
    if checks < 3:
        raise SystemExit(f"--checks {checks}: a kept plan moves at the third check at the earliest; use 3 or more")
    report = {"repeats": repeats, "profile_steps": steps,
              "scheduler": {"dynamic_rebalancing": True, "check_interval": interval}, "checks": checks,
              "scenarios": {}}
    started = time.time()
    even = [BATCH // 2, BATCH // 2]
    lines = []
    for name, speeds in SCENARIOS.items():
        runs = []
        for repeat in range(repeats):
            began = time.time()
            result = run_ranks(_dynamic, world_size=2, timeout=600, args=(speeds, steps, interval, checks))[0]
            result["seconds"] = round(time.time() - began, 1)
            runs.append(result)
            print(f"[bench] {name} run {repeat + 1}/{repeats}: start-up {result['startup']}, after profiling "
                  f"{result['after_profiling']}{' (kept)' if result['kept'] else ''}, events "
                  f"{[(e['step'], e['kind'], e['old'], e['new']) for e in result['events']]}, final {result['final']} "
                  f"({result['seconds']} s)", flush=True)
        profiling_moved = [run["after_profiling"] != run["startup"] for run in runs]
        final_uneven = [run["final"] != even for run in runs]
        final_rank0 = [run["final"][0] > BATCH // 2 for run in runs]
        entry = {"speeds": speeds,
                 "profiling_moved": sum(profiling_moved) / repeats,
                 "profiling_kept": sum(run["kept"] for run in runs) / repeats,
                 "later_check_moved": sum(run["later_moved"] for run in runs) / repeats,
                 "final_uneven": sum(final_uneven) / repeats,
                 "final_to_rank_0": sum(final_rank0) / repeats,
                 "kept_then_corrected": sum(run["kept"] and rank0 for run, rank0 in zip(runs, final_rank0)) / repeats,
                 "plans_after_profiling": [run["after_profiling"] for run in runs],
                 "final_plans": [run["final"] for run in runs]}
        if name == "equal":
            entry["target"] = f"final_uneven <= {TARGET_EQUAL_MOVES}"
            entry["met"] = entry["final_uneven"] <= TARGET_EQUAL_MOVES
            wrong = final_uneven
        else:
            entry["target"] = f"final_to_rank_0 >= {TARGET_DETECTED}"
            entry["met"] = entry["final_to_rank_0"] >= TARGET_DETECTED
            wrong = [not ok for ok in final_rank0]
        # The profiling measurements only of the runs whose final plan is wrong (as the gate's JSON).
        entry["runs"] = [{key: value for key, value in run.items() if key != "history" or bad}
                         for run, bad in zip(runs, wrong)]
        report["scenarios"][name] = entry
        line = (f"{name:>15}: profiling moved {entry['profiling_moved']:.2f}, later check moved "
                f"{entry['later_check_moved']:.2f}, final uneven {entry['final_uneven']:.2f}, final to rank 0 "
                f"{entry['final_to_rank_0']:.2f}, final plans {entry['final_plans']}; target {entry['target']}: "
                f"{'met' if entry['met'] else 'MISSED'}")
        lines.append(line)
        print(line, flush=True)
    report["seconds"] = round(time.time() - started, 1)
    print(f"\nprofile_steps {steps}, check_interval {interval}, {checks} checks, {repeats} runs per scenario")
    print("\n".join(lines))
    print(f"targets: equal ranks end uneven in at most {TARGET_EQUAL_MOVES:.2f} of runs (the gate's own target); "
          f"a rank at 0.4 or 0.25 ends with work moved to rank 0 in at least {TARGET_DETECTED:.2f}")
    name = ("profiling_gate_dynamic.json" if (steps, interval, checks) == (3, 20, 4)
            else f"profiling_gate_dynamic_p{steps}_k{interval}_c{checks}.json")
    results = RESULTS.with_name(name)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {results.relative_to(REPO)} ({report['seconds']} s)")


def _strict_reading_moves(history, startup):
    """Whether the gate would move work reading the start-up plan's measured times with the noise
    of the micro-steps they came from (sqrt(n / count) times each rank's level error)."""
    from deepspeed.runtime.heterogeneous.planning.plan import Plan
    from deepspeed.runtime.heterogeneous.planning.profiling import (fit_steps, measured_time_models, rank_errors,
                                                                    ran_plan, significant_difference,
                                                                    startup_plan_times)
    startup = Plan.from_dict(startup)
    models, fits = measured_time_models(history, 1)
    measured = [step for step in history[1:] if ran_plan(step, startup)]
    times = startup_plan_times(history, startup)
    fitted = [sum(len(step[rank]["samples"]) for step in fit_steps(history)) for rank in range(2)]
    errors = [error * math.sqrt(n / len(measured)) for error, n in zip(rank_errors(history, models, fits), fitted)]
    return significant_difference(models, errors, startup, times=times) is not None


def main():
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else REPEATS
    steps = int(sys.argv[sys.argv.index("--profile-steps") + 1]) if "--profile-steps" in sys.argv else 3
    if "--dynamic" in sys.argv:
        return _dynamic_main(repeats, steps)
    report = {"repeats": repeats, "profile_steps": steps, "scenarios": {}}
    started = time.time()
    for name, speeds in SCENARIOS.items():
        runs = []
        for _ in range(repeats):
            result = run_ranks(_profile, world_size=2, timeout=600, args=(speeds, steps))[0]
            runs.append({"plan": result["plan"], "history": result["history"],
                         "strict_reading_moves": _strict_reading_moves(result["history"], result["startup"])})
        moved = [run["plan"] != [BATCH // 2, BATCH // 2] for run in runs]
        toward_rank0 = [run["plan"][0] > BATCH // 2 for run in runs]
        entry = {"speeds": speeds, "plans": [run["plan"] for run in runs],
                 "moved": sum(moved) / repeats, "moved_to_rank_0": sum(toward_rank0) / repeats,
                 "strict_reading_moved": sum(run["strict_reading_moves"] for run in runs) / repeats}
        # The profiling measurements of each run whose verdict was wrong, for a reader to inspect.
        wrong = moved if name == "equal" else [not ok for ok in toward_rank0]
        entry["wrong_runs"] = [{"plan": run["plan"], "history": run["history"]}
                               for run, bad in zip(runs, wrong) if bad]
        if name == "equal":
            entry["target"] = f"moved <= {TARGET_EQUAL_MOVES}"
            entry["met"] = entry["moved"] <= TARGET_EQUAL_MOVES
        else:
            entry["target"] = f"moved_to_rank_0 >= {TARGET_DETECTED}"
            entry["met"] = entry["moved_to_rank_0"] >= TARGET_DETECTED
        report["scenarios"][name] = entry
        print(f"{name:>15}: moved {entry['moved']:.2f} (strict reading {entry['strict_reading_moved']:.2f}), "
              f"to rank 0 {entry['moved_to_rank_0']:.2f}, plans {entry['plans']}; target {entry['target']}: "
              f"{'met' if entry['met'] else 'MISSED'}", flush=True)
    report["seconds"] = round(time.time() - started, 1)
    results = RESULTS if steps == 3 else RESULTS.with_name(f"profiling_gate_{steps}.json")
    results.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {results.relative_to(REPO)} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
