# SPDX-License-Identifier: Apache-2.0
"""Predicted against measured memory peaks, per rank.

For each row, two fresh ranks train 3 steps with the fork's memory pool on
(``heterogeneous_memory.enabled``, even ZeRO shares, uniform split) and the row's ZeRO stage,
dtype, optimizer and offload setting. Each rank runs in a memory cgroup of its own, joined just
before ``deepspeed.initialize`` (a limit far above the run's needs: it measures, it never kills),
so the fork's ``memory/meter.py`` reads the cgroup. The prediction is the pool's
``predicted_peak_bytes`` for the rank (``memory/peak.py``: what was in use as the engine started,
DeepSpeed's allocations at its busiest phase, and the activations measured at the first step);
the measurement is the cgroup's peak (``memory.max_usage_in_bytes``, read and reset at the end of
each phase: initialize, forward, backward, step; the largest). The ratio is
measured / predicted: above 1 the model under-predicts (what kills), below it over-predicts (what
costs throughput). Targets, reported and not asserted: every row within +-10%, none more than 5%
under the measured peak.

Models:
- ``large``: 12 x Linear(1536, 1536), 28.3M parameters in 24 tensors (a few large layers);
- ``gpt``: a small GPT (vocabulary 8192, width 384, 6 layers, 6 heads, sequence 128), 18.4M;
- ``many``: 400 x Linear(128, 128) with ReLU, 6.6M parameters in 800 small tensors (buckets and
  padding);
- ``hf`` (``--hf``): a transformers GPT-2 (4 layers, width 256, 4 heads, sequence 64, vocabulary
  8192; 5.3M parameters) as users build one: each rank in its cgroup from the start (a job
  scheduler's, set from outside), the model built there under ``deepspeed.zero.Init`` with
  ``zero_partitions`` "auto" (ZeRO-3), rank 1's cgroup limited to ``HF_LIMIT_MIB`` so that its
  memory binds; ``hf-lora`` the same with PEFT LoRA adapters (``c_attn``, ``c_proj``) and gradient
  checkpointing, ZeRO-2 and 3.

    python tests/perf/bench_memory_model.py [--quick] [--rows large-2-fp32-adam ...] [--phases]
    python tests/perf/bench_memory_model.py --zero3-shares      # ZeRO-3, rank 1 at a share of 0.2
    python tests/perf/bench_memory_model.py --hf                # the transformers rows
    python tests/perf/bench_memory_model.py --limits

``--limits`` puts rank 1 under a memory limit set from outside at 85% and 60% of upstream's
even-share peak, in ZeRO-1, 2 and 3, and runs upstream and the fork (default threshold) side by
side: killed / refused / trained, with the fork's micro-batches, predicted and measured peaks and the
largest difference from single-process training (tests/perf/results/memory_limits.json, ~8 min).
``--quick`` runs the ``large`` model's fp32 Adam rows only. The full run (about 30 min on 2 cores)
writes tests/perf/results/memory_model.json. Needs root and the cgroup memory controller.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

STEPS, GLOBAL_BATCH = 3, 8
METER_BYTES = 64 * 2**30  # a limit that only measures
TARGET_WITHIN, TARGET_UNDER = 0.10, 0.05
ZERO3_SHARES = (0.8, 0.2)
HF_SEQUENCE, HF_VOCAB = 64, 8192
HF_LIMIT_MIB = (METER_BYTES >> 20, 200)  # per rank; rank 1's binds for the GPT-2's even shares
HF_SAMPLE_BYTES = 12 * 2**20  # heterogeneous_memory.activation_bytes_per_sample: the GPT-2's, rounded up
RESULTS = REPO / "tests" / "perf" / "results" / "memory_model.json"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def build_model(name):
    import torch
    torch.manual_seed(0)
    if name == "large":
        return torch.nn.Sequential(*[torch.nn.Linear(1536, 1536) for _ in range(12)])
    if name == "many":
        layers = []
        for _ in range(400):
            layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    return TinyGPT()


def build_hf_model(row, config):
    """The ``hf`` rows' GPT-2 as transformers builds it under a ZeRO-3 config (``zero.Init``, with the
    config the engine gets), then LoRA adapters and gradient checkpointing (``hf-lora``)."""
    import contextlib
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=HF_SEQUENCE, vocab_size=HF_VOCAB, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config) if row["stage"] == 3 else contextlib.nullcontext():
        model = GPT2LMHeadModel(gpt2)
    if row["model"] == "hf-lora":
        from peft import LoraConfig, get_peft_model
        model.gradient_checkpointing_enable()
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                                                 target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"))
    return model


def _tiny_gpt_class():
    import torch

    class TinyGPT(torch.nn.Module):
        """Token and position embeddings, 6 pre-norm encoder layers with a causal mask, a head."""

        def __init__(self, vocab=8192, width=384, layers=6, heads=6, sequence=128):
            super().__init__()
            self.tokens = torch.nn.Embedding(vocab, width)
            self.positions = torch.nn.Embedding(sequence, width)
            layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, vocab)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(sequence),
                                 persistent=False)

        def forward(self, ids):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            return self.head(self.blocks(x, mask=self.mask, is_causal=True))

    return TinyGPT


def TinyGPT():  # noqa: N802 - a class built on first use (torch is imported in the ranks only)
    return _tiny_gpt_class()()


def batch(name, step):
    import torch
    generator = torch.Generator().manual_seed(step)
    if name == "gpt":
        return torch.randint(0, 8192, (GLOBAL_BATCH, 129), generator=generator)
    if name.startswith("hf"):
        return torch.randint(0, HF_VOCAB, (GLOBAL_BATCH, HF_SEQUENCE), generator=generator)
    return torch.randn(GLOBAL_BATCH, 1536 if name == "large" else 128, generator=generator)


def loss_of(name, engine, rows):
    import torch
    if name.startswith("hf"):
        return engine(input_ids=rows, labels=rows).loss
    if name == "gpt":
        logits = engine(rows[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return engine(rows.to(next(engine.module.parameters()).dtype)).float().pow(2).mean()


def config_of(row):
    optimizer = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": not row["offload"]}} if row["optimizer"] == "adam" \
        else {"type": "SGD", "params": {"lr": 1e-3}}
    zero = {"stage": row["stage"]}
    if row["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0, "steps_per_print": 10**6,
              "zero_allow_untested_optimizer": True,
              "optimizer": optimizer, "zero_optimization": zero,
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform"},
              "heterogeneous_memory": {"enabled": True, "zero_partitions": row.get("shares", "even"),
                                       "adaptive_chunking": False}}
    if row["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    if row["model"].startswith("hf"):
        # "auto" leaves rank 1 room for its samples (without it, its state would fill the limit).
        config["heterogeneous_memory"].update(zero_partitions="auto", activation_bytes_per_sample=HF_SAMPLE_BYTES)
    return config


def _rank(rank, world_size, row):
    import deepspeed
    hf = row["model"].startswith("hf")
    if hf:  # imported before the cgroup is joined, as the interpreter and torch are
        import peft  # noqa: F401
        import transformers  # noqa: F401
        from deepspeed.runtime.heterogeneous.memory.meter import load_engine_modules
        load_engine_modules()
    cgroup = CGROUP_ROOT / f"bench-memory-model-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(HF_LIMIT_MIB[rank] << 20 if hf else METER_BYTES))
        if hf:  # the rank runs in its cgroup from the start, the model built there
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
            model = build_hf_model(row, config_of(row))
        else:
            model = build_model(row["model"])
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        engine, _, _, _ = deepspeed.initialize(model=model, config=config_of(row),
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        state = engine._config.heterogeneous
        size = GLOBAL_BATCH // world_size
        phase_peaks = {"initialize": _phase_peak(cgroup)}
        for step in range(STEPS):
            rows = batch(row["model"], step)[rank * size:(rank + 1) * size]
            loss = loss_of(row["model"], engine, rows)
            _keep_max(phase_peaks, "forward", _phase_peak(cgroup))
            engine.backward(loss)
            _keep_max(phase_peaks, "backward", _phase_peak(cgroup))
            engine.step()
            _keep_max(phase_peaks, "step", _phase_peak(cgroup))
        measured = max(phase_peaks.values())
        placed = state.memory_pool.placement.ranks[state.dp_rank]
        peak = state.memory_pool.predicted_peak(state.dp_rank, placed.activation_bytes or 0.0)
        return {"predicted": placed.predicted_peak_bytes, "measured": measured, "phase": placed.peak_phase,
                "shares": [r.share for r in state.memory_pool.placement.ranks],
                "baseline": placed.baseline_bytes, "activations": placed.activation_bytes,
                "allocations": peak.phases[peak.peak_phase], "measured_phases": phase_peaks,
                "predicted_phases": {name: int(peak.phase_bytes(name)) for name in peak.phases}}
    finally:
        (CGROUP_ROOT / "cgroup.procs").write_text(str(os.getpid()))
        cgroup.rmdir()


def _phase_peak(cgroup):
    """The cgroup's peak since the last call (v1 ``memory.max_usage_in_bytes``, then reset)."""
    peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
    (cgroup / "memory.max_usage_in_bytes").write_text("0")
    return peak


def _measured_phase(result, name):
    """The measured phase a predicted one falls in (the reduce closes ``engine.backward()``, the
    all-gather ``engine.step()``)."""
    return result["measured_phases"].get({"reduce": "backward", "all-gather": "step"}.get(name, name))


def _keep_max(peaks, phase, value):
    peaks[phase] = max(peaks.get(phase, 0), value)


def rows_for(quick):
    rows = []
    for model in (("large", ) if quick else ("large", "gpt", "many")):
        for stage in (0, 1, 2, 3):
            for dtype in (("fp32", ) if quick else ("fp32", "bf16")):
                for optimizer in (("adam", ) if quick else ("adam", "sgd")):
                    rows.append(dict(model=model, stage=stage, dtype=dtype, optimizer=optimizer, offload=False))
                if stage >= 1 and not quick:
                    rows.append(dict(model=model, stage=stage, dtype=dtype, optimizer="adam", offload=True))
    return rows + ([] if quick else zero3_share_rows())


def zero3_share_rows():
    """ZeRO-3 with uneven shares (rank 1 holds a fifth of every parameter), offload off and on."""
    return [dict(model=model, stage=3, dtype=dtype, optimizer="adam", offload=offload, shares=list(ZERO3_SHARES))
            for model in ("large", "gpt", "many") for dtype in ("fp32", "bf16") for offload in (False, True)]


def hf_rows():
    """The transformers GPT-2 built under zero.Init ("auto", ZeRO-3), and with LoRA and gradient
    checkpointing (ZeRO-2 and 3); fp32 Adam."""
    return [dict(model=model, stage=stage, dtype="fp32", optimizer="adam", offload=False)
            for model, stage in (("hf", 3), ("hf-lora", 3), ("hf-lora", 2))]


def row_name(row):
    shares = f"-shares{round(100 * row['shares'][0])}" if row.get("shares") else ""
    return (f"{row['model']}-{row['stage']}-{row['dtype']}-{row['optimizer']}{'-offload' if row['offload'] else ''}"
            f"{shares}")


def under_limits():
    """Rank 1 under a memory limit set from outside at 85% and 60% of upstream's even-share peak,
    ZeRO-1/2/3, upstream against the fork at the default threshold, side by side (the workload of
    tests/unit/heterogeneous/test_memory_scheduler_limit.py). Writes memory_limits.json."""
    sys.path.insert(0, str(REPO / "tests" / "unit" / "heterogeneous"))
    from test_memory_scheduler_limit import PREFIX, _train, reference
    want = reference()
    rows = []
    print(f"{'stage':>5s} {'limit':>13s} {'upstream':>16s} {'fork':>60s}")
    for stage in (1, 2, 3):
        _, calibration = run_ranks(_train, world_size=2, timeout=600, args=(False, stage, None))
        even = calibration["peak"]
        for fraction in (0.85, 0.60):
            limit = int(fraction * even)
            row = {"stage": stage, "fraction": fraction, "upstream_even_peak": even, "limit": limit}
            for who, fork in (("upstream", False), ("fork", True)):
                try:
                    first, second = run_ranks(_train, world_size=2, timeout=600, args=(fork, stage, limit))
                    exact = max((a - b).abs().max().item() for r in (first, second)
                                for a, b in zip(r["params"], want))
                    row[who] = {"outcome": "trained", "peak": second["peak"], "max_abs_diff": exact,
                                **({"micro_batch_sizes": second["sizes"], "predicted": second["predicted"]} if fork else {})}
                except AssertionError as exc:
                    text = str(exc)
                    outcome = "killed" if "exited with code -9" in text else "refused" if "raised" in text else "failed"
                    row[who] = {"outcome": outcome, "message": text[-500:]}
                for stale in CGROUP_ROOT.glob(f"{PREFIX}*"):  # a killed rank's cgroup
                    stale.rmdir()
            rows.append(row)

            def cell(entry):
                if entry["outcome"] != "trained":
                    return entry["outcome"]
                sizes = f" micro-batches {entry['micro_batch_sizes']}" if entry.get("micro_batch_sizes") else ""
                predicted = f" predicted {entry['predicted'] / 2**20:.0f}M" if entry.get("predicted") else ""
                return f"trained, peak {entry['peak'] / 2**20:.0f}M{predicted}{sizes}, diff {entry['max_abs_diff']:.1e}"
            print(f"{stage:>5d} {fraction:>4.0%} {limit / 2**20:6.0f}M  {cell(row['upstream']):>16s}  {cell(row['fork'])}",
                  flush=True)
    path = RESULTS.with_name("memory_limits.json")
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--limits", action="store_true",
                        help="rank 1 under an outside limit at 85%% and 60%% of upstream's peak: upstream vs the fork")
    parser.add_argument("--rows", nargs="*", help="row names to run (e.g. large-2-fp32-adam)")
    parser.add_argument("--phases", action="store_true", help="print predicted/measured bytes per phase")
    parser.add_argument("--hf", action="store_true",
                        help="only the transformers GPT-2 rows (writes memory_model_hf.json)")
    parser.add_argument("--zero3-shares", action="store_true",
                        help="only the ZeRO-3 rows with uneven shares (writes memory_model_zero3_shares.json)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP_ROOT / "cgroup.procs").exists():
        sys.exit("bench_memory_model.py needs root and the cgroup v1 memory controller")
    if args.limits:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        return under_limits()
    rows = [r for r in rows_for(args.quick and not args.rows) + hf_rows() if not args.rows or row_name(r) in args.rows]
    rows = [r for r in rows if args.rows or not r["model"].startswith("hf")]
    if args.zero3_shares:
        rows = zero3_share_rows()
    if args.hf:
        rows = hf_rows()
    results = []
    header = f"{'row':30s} {'rank':>4s} {'at start':>9s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}  peak phase"
    print(header)
    print("-" * len(header))
    for row in rows:
        began = time.time()
        try:
            outcome = run_ranks(_rank, world_size=2, timeout=600, args=(row, ))
            error = None
        except AssertionError as exc:
            outcome, error = [None, None], str(exc)[-600:]
        for rank, result in enumerate(outcome):
            entry = {"row": row_name(row), **row, "rank": rank, "seconds": round(time.time() - began, 1)}
            if result is None:
                entry["error"] = error
                print(f"{row_name(row):30s} {rank:>4d} failed: {error.splitlines()[-1] if error else ''}")
            else:
                ratio = result["measured"] / result["predicted"]
                entry.update(result, ratio=ratio, within=abs(ratio - 1) <= TARGET_WITHIN,
                             under_by_more_than_5pct=ratio > 1 + TARGET_UNDER)
                print(f"{row_name(row):30s} {rank:>4d} {result['baseline'] / 2**20:8.0f}M "
                      f"{result['predicted'] / 2**20:9.0f}M {result['measured'] / 2**20:9.0f}M {ratio:6.2f}  "
                      f"{result['phase']}", flush=True)
                if args.phases:
                    print(f"      activations {(result['activations'] or 0) / 2**20:.1f}M; " + "  ".join(f"{name} {result['predicted_phases'][name] / 2**20:.0f}/"
                                                f"{_measured_phase(result, name) / 2**20:.0f}M"
                                                for name in result["predicted_phases"]))
            results.append(entry)
    measured = [r for r in results if "ratio" in r]
    summary = {"rows": len(measured), "within_10pct": sum(r["within"] for r in measured),
               "under_by_more_than_5pct": sum(r["under_by_more_than_5pct"] for r in measured),
               "failed": len(results) - len(measured)}
    print(f"\n{summary['within_10pct']}/{summary['rows']} rank-rows within +-10% (target: all); "
          f"{summary['under_by_more_than_5pct']} under-predict by more than 5% (target: none); "
          f"{summary['failed']} failed")
    if args.zero3_shares or args.hf or (not args.quick and not args.rows):
        path = RESULTS.with_name("memory_model_zero3_shares.json" if args.zero3_shares else "memory_model_hf.json") \
            if args.zero3_shares or args.hf else RESULTS
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
