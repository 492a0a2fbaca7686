# SPDX-License-Identifier: Apache-2.0
"""A node lost and a node added: how long an elastic heterogeneous run takes to recover, and
whether it stays exact.

1. **A lost node.** Three torchrun agents (``--nnodes 2:3``, one worker each, c10d rendezvous,
   ``--max-restarts 3``) train tests/unit/scripts/elastic_train.py (ZeRO-2 Adam, plan [4, 3, 1],
   memory shares [0.5, 0.3, 0.2], a periodic checkpoint every ``--every`` steps, ``--step-sleep``
   seconds added to every step so that a step has a length worth redoing). At a step drawn with
   ``--seed`` the third agent kills itself and its worker. Reported: the time to recover, split
   into detection + rendezvous + spawn (the kill to the survivors' new workers), start-up (the
   engine built and the checkpoint loaded, of which the conversion to a universal checkpoint), and
   the steps redone with their time; the final parameters against (a) one process's Adam on the
   global batches the run was made of and (b) a 2-rank run that loads the same checkpoint and
   trains to the end (the run that changed world at that checkpoint, no failure).
2. **A node added.** The same checkpoint loaded on 4 ranks ([3, 2, 2, 1]): the new plan, the
   load time (the conversion is reused), and the parameters after the same steps against (b).

Prints a table and writes ``tests/perf/results/elastic.json``.

    python tests/perf/bench_elastic.py [--steps 24] [--every 5] [--step-sleep 0.2] [--seed 0]   (~2 min)
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "tests" / "unit" / "heterogeneous")]

from harness import run_subcases  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "elastic.json"


def _continue(rank, world_size, folder, tag, steps):
    """Load ``tag`` on this world and train to ``steps`` (the script's model, data and config)."""
    import contextlib
    import io
    import importlib.util

    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    spec = importlib.util.spec_from_file_location("elastic_train", REPO / "tests" / "unit" / "scripts" /
                                                  "elastic_train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = script.samples()
    model = script.make_model()
    config = script.config(world_size)  # no periodic saves into the job's folder
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    printed = io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        engine.load_checkpoint(folder, tag=tag)
    load_s = time.perf_counter() - began
    iterator = iter(loader)
    while engine.global_steps < steps:
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                inputs, targets = next(iterator)
            except StopIteration:
                loader.batch_sampler.set_epoch(loader.batch_sampler.epoch + 1)
                iterator = iter(loader)
                inputs, targets = next(iterator)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
    return {"params": [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()],
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes), "load_s": load_s,
            "printed": printed.getvalue()}


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="24: two epochs of 96 samples")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from references import adam_mse_reference
    from test_elastic import BATCH, LR, effective_steps, make_model, recording_dataset, run_elastic_job

    kill_at = random.Random(args.seed).randint(args.every + 1, args.steps - 2)
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as folder:
        out = Path(folder)
        codes, output, events, seconds = run_elastic_job(out, steps=args.steps, every=args.every, kill_at=kill_at,
                                                         step_sleep=args.step_sleep, timeout=900)
        if codes[:2] != [0, 0]:
            sys.exit(f"the survivors did not finish (exit codes {codes}):\n" + "\n".join(output)[-6000:])
        kill = next(e for e in events if e["kind"] == "kill")
        finished = max(e["attempt"] for e in events if e["kind"] == "done")
        restart = min(e["time"] for e in events if e["kind"] == "start" and e["attempt"] == finished)
        loaded = [e for e in events if e["kind"] == "loaded" and e["attempt"] == finished]
        loaded_at, load_end = loaded[0]["step"], max(e["time"] for e in loaded)
        conversion = json.loads((out / "checkpoints" / f"global_step{loaded_at}.universal" /
                                 "deepspeed_hetero_conversion.json").read_text())
        redone = kill["step"] - loaded_at
        redo_end = max(e["time"] for e in events if e["kind"] == "step" and e["attempt"] == finished
                       and e["step"] == kill["step"])
        steps_3 = sorted(e["time"] for e in events if e["kind"] == "step" and e["world"] == 3 and e["rank"] == 0)
        step_s = (steps_3[-1] - steps_3[0]) / max(1, len(steps_3) - 1)
        final = torch.load(out / "final.pt")
        data = recording_dataset()
        reference = adam_mse_reference(make_model(), data.inputs, data.targets, effective_steps(events), LR)
        tag, folder_ckpt = f"global_step{loaded_at}", str(out / "checkpoints")
        cases = [dict(folder=folder_ckpt, tag=tag, steps=args.steps)]
        (on_two,), = [run_subcases(_continue, cases, world_size=2, timeout=900)]
        (on_four,), = [run_subcases(_continue, cases, world_size=4, timeout=900)]
    from collections import Counter
    fed = Counter(i for step in effective_steps(events) for i in step)
    row = {
        "kill_at_step": kill["step"], "checkpoint_loaded": loaded_at, "steps_redone": redone,
        "step_s_on_3": step_s, "job_s": seconds,
        "detect_rendezvous_spawn_s": restart - kill["time"],
        "startup_and_load_s": load_end - restart, "conversion_s": conversion["seconds"],
        "redo_s": redo_end - load_end, "recovered_s": redo_end - kill["time"],
        "recovered_in_steps_on_3": (redo_end - kill["time"]) / step_s,
        "each_sample_once_per_epoch": set(fed.values()) == {args.steps * BATCH // 96} and len(fed) == 96,
        "max_abs_diff_vs_adam_reference": _max_diff(final["params"], [p.detach() for p in reference]),
        "max_abs_diff_vs_run_changed_at_checkpoint": _max_diff(final["params"], on_two[0]["params"]),
        "join_on_4": {"plan": on_four[0]["plan"], "load_s": on_four[0]["load_s"],
                      "printed": on_four[0]["printed"].strip(),
                      "max_abs_diff_vs_2_ranks": _max_diff(on_four[0]["params"], on_two[0]["params"])},
    }
    print(f"elastic: 3 agents, ZeRO-2 [4, 3, 1], checkpoint every {args.every} steps, {args.steps} steps, "
          f"+{args.step_sleep} s per step; the third agent killed after step {kill['step']}")
    print(f"  recovered in {row['recovered_s']:.1f} s ({row['recovered_in_steps_on_3']:.0f} steps' time on 3 ranks): "
          f"detection + rendezvous + spawn "
          f"{row['detect_rendezvous_spawn_s']:.1f} s, start-up + load {row['startup_and_load_s']:.1f} s (conversion "
          f"{row['conversion_s']:.1f} s), {redone} step(s) redone in {row['redo_s']:.1f} s "
          f"(a step took {step_s:.2f} s on 3 ranks)")
    print(f"  each sample once per epoch: {row['each_sample_once_per_epoch']}; final parameters vs one process's Adam: "
          f"{row['max_abs_diff_vs_adam_reference']:.2e}, vs the run that changed world at {tag}: "
          f"{row['max_abs_diff_vs_run_changed_at_checkpoint']:.2e}")
    print(f"  joined: {tag} on 4 ranks, plan {row['join_on_4']['plan']}, loaded in {row['join_on_4']['load_s']:.1f} s; "
          f"parameters vs the 2-rank run: {row['join_on_4']['max_abs_diff_vs_2_ranks']:.2e}")
    print(f"  {row['join_on_4']['printed']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "result": row}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
