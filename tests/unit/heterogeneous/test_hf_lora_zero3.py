# SPDX-License-Identifier: Apache-2.0
"""The LoRA fine-tuning recipe on ZeRO-3 with uneven shards, as users run it
(tests/unit/scripts/hf_lora_zero3.py under the deepspeed launcher): ``TrainingArguments`` with the
ZeRO-3 config first, the model from ``AutoModelForCausalLM.from_config`` (built under
``zero.Init`` before any process group), PEFT LoRA, gradient checkpointing, the stock Trainer and
``HeterogeneousTrainer`` on the splits [8, 8], [12, 4] and [4, 12].

Against one process (plain torch and peft, SGD on the union of what the ranks were fed at each
step, the mean over the global batch's tokens; SGD shows a wrong gradient scale where Adam would
hide it): the trained adapters, the tokens ``generate`` gives between steps, the evaluation loss
(``prediction_step``), the Trainer's checkpoint merged by ``zero_to_fp32``, the adapters
``save_model`` wrote (loaded with ``PeftModel.from_pretrained``), the model merged from them and
saved with ``save_pretrained``, and a run resumed from the Trainer's checkpoint.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from harness import REPO_ROOT, launch_deepspeed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_lora_zero3.py"
STEPS, RESUME_AT = 4, 2
SPLITS = ["8,8", "12,4", "4,12"]
CASES = [f"{trainer}:{split}" for trainer in ("hetero", "stock") for split in SPLITS]


def _available():
    missing = [name for name in ("transformers", "accelerate", "peft") if importlib.util.find_spec(name) is None]
    # CI installs them (the Makefile's test dependencies): never let the test vanish there.
    assert not (missing and os.environ.get("CI") == "true"), f"{missing} must be installed in CI"
    return not missing


def _load_script():
    spec = importlib.util.spec_from_file_location("hf_lora_zero3", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _base_and_lora(script, initial):
    """One process's model: GPT-2 from the same config, the same adapters, the run's initial values."""
    from peft import get_peft_model
    from transformers import GPT2LMHeadModel
    model = get_peft_model(GPT2LMHeadModel(script.model_config()), script.lora_config())
    missing = set(dict(model.named_parameters())) ^ set(initial)
    assert not missing, f"parameter names differ from the run's: {sorted(missing)[:4]}"
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(initial[name])
    return model


def _reference(script, initial, global_batches):
    """SGD on each global batch (the mean over its tokens); the trainable parameters after each
    step, and the tokens ``generate`` gives after step ``GENERATE_AT``."""
    model = _base_and_lora(script, initial)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=script.LR)
    ids = script.tokens()
    states, generated = [], None
    for step, indices in enumerate(global_batches, start=1):
        optimizer.zero_grad()
        model(input_ids=ids[indices], labels=ids[indices]).loss.backward()
        optimizer.step()
        states.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        if step == script.GENERATE_AT:
            model.eval()
            with torch.no_grad():
                generated = model.generate(input_ids=torch.tensor(script.PROMPT), max_new_tokens=script.NEW_TOKENS,
                                           min_new_tokens=script.NEW_TOKENS, do_sample=False).tolist()
            model.train()
    with torch.no_grad():
        rows = ids[:script.EVAL_SAMPLES]
        eval_loss = model(input_ids=rows, labels=rows).loss.item()
    return model, states, generated, eval_loss


def _assert_close(got, want, start, what):
    for name, value in want.items():
        assert torch.allclose(got[name], value, rtol=0, atol=1e-6), \
            f"{what} {name}: max |diff| {(got[name] - value).abs().max().item():.3g}"
        if start is not None and name in start and ".lora_B." in name:
            # B starts at zero: its whole value is the update, and SGD's shows the gradient's scale.
            assert value.abs().max() > 1e-3, f"{what} {name}: the update is too small to tell a scale apart"


def _merged_from_saved(script, initial, adapters, where):
    """What a user does next: load the saved adapters onto the base model, merge, save_pretrained,
    and load that back."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel
    base = GPT2LMHeadModel(script.model_config())
    prefix = "base_model.model."
    with torch.no_grad():
        for name, param in base.named_parameters():
            param.copy_(initial[prefix + name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")]
                        if prefix + name not in initial else initial[prefix + name])
    merged = PeftModel.from_pretrained(base, adapters).merge_and_unload()
    merged.save_pretrained(where)
    return {n: p.detach() for n, p in GPT2LMHeadModel.from_pretrained(where).named_parameters()}


@pytest.mark.skipif(not _available(), reason="transformers, accelerate and peft are not installed")
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_lora_with_gradient_checkpointing_on_uneven_zero3_shards_is_exact_saves_and_resumes(tmp_path):
    script = _load_script()
    args = ["--out", tmp_path, "--steps", STEPS, "--resume-at", RESUME_AT]
    for case in CASES:
        args += ["--case", case]
    code, output = launch_deepspeed(SCRIPT, args, num_ranks=2, timeout=800, cwd=REPO_ROOT)
    assert code == 0, f"the recipe failed (exit {code}):\n{output[-6000:]}"
    first = None
    for case in CASES:
        trainer, split = case.split(":")
        sizes = [int(s) for s in split.split(",")]
        ranks = [torch.load(script.result_path(tmp_path, case).format(rank=rank)) for rank in range(2)]
        resumed = [torch.load(script.result_path(tmp_path, case, resumed=True).format(rank=rank)) for rank in range(2)]
        assert [r["shares"] for r in ranks] == [tuple(script.SHARES)] * 2, case
        assert [r["plan"] for r in ranks] == [sizes] * 2, case
        assert [r["checkpointing"] for r in ranks] == [True, True], case
        fed = [r["fed"] for r in ranks]
        # HeterogeneousTrainer feeds the plan; the stock Trainer feeds equal batches the engine re-splits.
        fed_sizes = [8, 8] if trainer == "stock" else sizes
        assert [len(batch) for batch in fed[0]] == [fed_sizes[0]] * STEPS, (case, fed[0])
        global_batches = [fed[0][step] + fed[1][step] for step in range(STEPS)]
        initial = ranks[0]["initial"]
        torch.testing.assert_close(ranks[1]["initial"], initial, rtol=0, atol=0)
        model, states, generated, eval_loss = _reference(script, initial, global_batches)
        for rank in range(2):
            _assert_close(ranks[rank]["trainable"], states[-1], initial, f"{case} rank {rank}")
            assert ranks[rank]["generated"] == generated, (case, ranks[rank]["generated"], generated)
            # Resumed at step RESUME_AT: the same rows and the same parameters as the uninterrupted run.
            assert resumed[rank]["fed"] == fed[rank][RESUME_AT:], case
            _assert_close(resumed[rank]["trainable"], states[-1], None, f"{case} resumed, rank {rank}")
        assert [r["eval_loss"] for r in ranks] == pytest.approx([eval_loss] * 2, rel=1e-5), case
        case_dir = tmp_path / case.replace(":", "-").replace(",", "-")
        # zero_to_fp32 on the Trainer's checkpoint (uneven shards): the adapters at that step.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        merged_fp32 = get_fp32_state_dict_from_zero_checkpoint(str(case_dir / "trainer" / f"checkpoint-{RESUME_AT}"))
        at_save = states[RESUME_AT - 1]
        assert set(at_save) <= set(merged_fp32), sorted(set(at_save) - set(merged_fp32))[:4]
        _assert_close(merged_fp32, at_save, None, f"{case} zero_to_fp32")
        merged = _merged_from_saved(script, initial, case_dir / "adapters", tmp_path / f"{case_dir.name}-merged")
        want = model.merge_and_unload()
        _assert_close(merged, {n: p.detach() for n, p in want.named_parameters()}, None, f"{case} merged")
        # Split-invariant: the stock Trainer's sampler order differs from the heterogeneous one's,
        # so splits are compared within a trainer.
        if first is None or first[0] != trainer:
            first = (trainer, ranks[0]["trainable"])
        else:
            _assert_close(ranks[0]["trainable"], first[1], None, f"{case} against {first[0]} {SPLITS[0]}")
