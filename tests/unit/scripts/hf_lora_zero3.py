# SPDX-License-Identifier: Apache-2.0
"""The fine-tuning recipe most users run, in transformers' own order: ``TrainingArguments`` with a
ZeRO-3 DeepSpeed config, then ``AutoModelForCausalLM.from_config`` (which builds the model under
``deepspeed.zero.Init`` before any process group exists; ``from_pretrained`` takes the same path
once the weights are read), PEFT LoRA adapters (``get_peft_model``), gradient checkpointing, the
Trainer. Run by tests/unit/heterogeneous/test_hf_lora_zero3.py under the deepspeed launcher.

One launch trains every case given (``TRAINER:A,B``: ``stock`` or ``hetero`` for
``HeterogeneousTrainer``, the manual split [A, B] of the global batch) for ``--steps`` SGD steps,
ZeRO-3 with uneven shares [0.7, 0.3]. Per case and rank it writes ``<out>/<trainer>-<A>-<B>-rank<r>.pt``:
the full initial parameters (gathered before the first step), what the rank fed at every step, the
trainable parameters after training, the tokens ``generate`` produced after step ``GENERATE_AT``, and
the adapters ``save_model`` wrote (``<out>/<case>/adapters``) and the merged model's state rank 0
saved (``<out>/<case>/merged``). With ``--resume-at K`` the case also trains again, a new Trainer
resumed from its step-K checkpoint, to ``...-resumed-rank<r>.pt``.

    deepspeed --num_gpus 2 tests/unit/scripts/hf_lora_zero3.py --out DIR --case hetero:12,4
"""

import argparse
import os

import torch

DATASET = 64
SEQUENCE = 16
VOCAB = 64
GLOBAL_BATCH = 16
LR = 0.5
DATA_SEED = 42
LORA_SEED = 11
MODEL_SEED = 7
GENERATE_AT = 2
PROMPT = [[1, 2, 3, 4]]
NEW_TOKENS = 4
SHARES = [0.7, 0.3]


def model_config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQUENCE, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                      task_type="CAUSAL_LM")


def tokens():
    return torch.randint(1, VOCAB, (DATASET, SEQUENCE), generator=torch.Generator().manual_seed(3))


EVAL_SAMPLES = 16


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self, size=DATASET):
        self.ids = tokens()[:size]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def ds_config(split):
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
        "zero_allow_untested_optimizer": True,
        "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": split},
        "heterogeneous_memory": {"enabled": True, "zero_partitions": SHARES},
    }


def result_path(out, case, resumed=False):
    trainer, split = case.split(":")
    return os.path.join(out, f"{trainer}-{split.replace(',', '-')}{'-resumed' if resumed else ''}-rank{{rank}}.pt")


def gathered_state(model):
    """Every parameter in full (ZeRO-3 gathers them), on every rank."""
    import deepspeed
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def train(case, out, steps, save_at=None, resume=False):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from deepspeed.runtime.heterogeneous.integrations.hf_trainer import HeterogeneousTrainer

    trainer_kind, split = case.split(":")
    split = [int(size) for size in split.split(",")]
    world_size = int(os.environ["WORLD_SIZE"])
    case_dir = os.path.join(out, case.replace(":", "-").replace(",", "-"))
    rows = {tuple(row.tolist()): index for index, row in enumerate(tokens())}
    fed, generated, initial = [], {}, {}

    # TrainingArguments first: with a ZeRO-3 config it makes from_config build under zero.Init.
    args = TrainingArguments(output_dir=os.path.join(case_dir, "trainer"),
                             per_device_train_batch_size=GLOBAL_BATCH // world_size,
                             per_device_eval_batch_size=EVAL_SAMPLES // world_size,
                             gradient_accumulation_steps=1, max_steps=steps, learning_rate=LR,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, seed=DATA_SEED,
                             activation_checkpointing=True, deepspeed=ds_config(split), report_to=[],
                             save_strategy="steps" if save_at else "no", save_steps=save_at or 500,
                             logging_strategy="no", disable_tqdm=True, use_cpu=True)
    # Seeded: a resumed run builds the base model again, and a ZeRO-3 checkpoint holds the trained
    # parameters only (from_pretrained would read the same weights again).
    torch.manual_seed(MODEL_SEED)
    model = AutoModelForCausalLM.from_config(model_config())
    model.loss_type = "ForCausalLM"
    torch.manual_seed(LORA_SEED)  # the adapters' initialisation, the same on every rank
    model = get_peft_model(model, lora_config())

    class Recording(Trainer if trainer_kind == "stock" else HeterogeneousTrainer):

        def training_step(self, model, inputs, num_items_in_batch=None):
            if not initial and not resume:
                initial.update(gathered_state(self.model_wrapped.module))
            fed.append([rows[tuple(row.tolist())] for row in inputs["input_ids"]])
            return super().training_step(model, inputs, num_items_in_batch)

    class GenerateBetweenSteps(TrainerCallback):

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == GENERATE_AT and not resume:
                module = trainer.model_wrapped.module
                module.eval()
                with torch.no_grad():
                    out_ids = module.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS,
                                              min_new_tokens=NEW_TOKENS, do_sample=False, synced_gpus=True)
                module.train()
                generated["tokens"] = out_ids.tolist()

    trainer = Recording(model=model, args=args, train_dataset=TokenDataset(), callbacks=[GenerateBetweenSteps()])
    checkpoint = os.path.join(case_dir, "trainer", f"checkpoint-{save_at}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    engine = trainer.model_wrapped
    rank = int(os.environ["RANK"])
    trainable = {name: p for name, p in gathered_state(engine.module).items()
                 if dict(engine.module.named_parameters())[name].requires_grad}
    result = {"fed": fed, "trainable": trainable, "generated": generated.get("tokens"), "initial": initial,
              "shares": engine.optimizer.zero3_shares, "plan": list(engine.heterogeneous_plan.micro_batch_sizes),
              "checkpointing": bool(engine.module.get_base_model().is_activation_checkpointing)}
    if not resume:
        # Evaluation (the Trainer's prediction_step on its own equal shards) and the adapters saved
        # through the engine's 16-bit gather (stage3_gather_16bit_weights_on_model_save).
        result["eval_loss"] = trainer.evaluate(TokenDataset(EVAL_SAMPLES))["eval_loss"]
        trainer.save_model(os.path.join(case_dir, "adapters"))
    torch.save(result, result_path(out, case, resume).format(rank=rank))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True, help="TRAINER:A,B (see the docstring)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume-at", type=int, default=None)
    args = parser.parse_args()
    try:
        for case in args.case:
            train(case, args.out, args.steps, save_at=args.resume_at)
            if args.resume_at:
                train(case, args.out, args.steps, save_at=args.resume_at, resume=True)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
