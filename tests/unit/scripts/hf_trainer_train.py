# SPDX-License-Identifier: Apache-2.0
"""transformers.Trainer with heterogeneous_config, run by tests/unit/heterogeneous/test_hf_trainer.py
under the deepspeed launcher.

Trains a tiny GPT-2 (built from a config, no download) once per case given on the command line,
each with a fresh Trainer and engine, and writes per rank what it fed the model at every
micro-step (dataset indices), the plan in force then, the trained parameters and the evaluation
loss, to ``<out>/<loss>-<gas>-<change>-rank<r>.pt``. The test replays the same global batches in
one process. A case is ``LOSS:GAS:CHANGE``:

- LOSS ``global_mean``: the Trainer's default for a causal LM (loss over the global batch's token
  count); ``rank_mean``: average_tokens_across_devices=False (each rank's own mean).
- CHANGE ``profiling``: rank 1 emulated at a tenth of rank 0's speed (time dilation) and 3
  profiling steps, which re-plan from what they measure (the outcome depends on the timings);
  ``on_demand``: no profiling, and ``engine.reschedule_workload`` with rank 1 three times slower
  at the end of step 2, a certain change to [12, 4].

    deepspeed --num_gpus 2 tests/unit/scripts/hf_trainer_train.py --out DIR --case global_mean:1:on_demand

With ``--resume-at K`` each case also saves a checkpoint at step K and then trains again, a new
Trainer resumed from that checkpoint, to ``<loss>-<gas>-<change>-resumed-rank<r>.pt`` (its
``fed`` and ``plans`` from step K + 1 on).
"""

import argparse
import os

import torch

DATASET = 64
SEQUENCE = 16
VOCAB = 64
GLOBAL_BATCH = 16
LR = 1e-4
MODEL_SEED = 7
DATA_SEED = 42  # TrainingArguments.seed: the heterogeneous sampler's base seed (epoch e: DATA_SEED + e)


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQUENCE, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(MODEL_SEED)
    model = GPT2LMHeadModel(config)
    # Named up front: the Trainer reads it at construction to count a causal LM's shifted labels
    # (num_items_in_batch); left None, it counts one token too many per sample and scales the loss.
    model.loss_type = "ForCausalLM"
    return model


def tokens():
    """Every sample's token ids (distinct rows, so that a fed row names its sample)."""
    return torch.randint(0, VOCAB, (DATASET, SEQUENCE), generator=torch.Generator().manual_seed(3))


EVAL_SAMPLES = 16


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self, size=DATASET):
        self.ids = tokens()[:size]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


ON_DEMAND_STEP = 2
ON_DEMAND_BUSY_SECONDS = [1.0, 3.0]


def ds_config(stage, change):
    heterogeneous = {"enabled": True, "load_balancing_strategy": "compute_aware"}
    if change == "profiling":
        heterogeneous.update(profile_steps=3, emulation={"speeds": [1.0, 0.1], "mode": "dilation"})
    elif change == "on_demand":
        heterogeneous.update(profile_steps=0)
    else:
        raise SystemExit(f"unknown plan change {change!r}: profiling or on_demand")
    return {
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                 "weight_decay": "auto", "torch_adam": True}},
        "heterogeneous_config": heterogeneous,
    }


def train(case, out, steps, stage, save_at=None, resume=False, stock=False):
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from deepspeed.runtime.heterogeneous.integrations.hf_trainer import HeterogeneousTrainer

    loss_kind, gas, change = case.split(":")
    gas = int(gas)
    world_size = int(os.environ["WORLD_SIZE"])
    rows = {tuple(row.tolist()): index for index, row in enumerate(tokens())}
    fed, plans = [], []

    class RecordingTrainer(Trainer if stock else HeterogeneousTrainer):
        """Records what each micro-step fed the model and the plan in force then."""

        def heterogeneous_engine(self):
            return self.model_wrapped  # the DeepSpeed engine (also for the stock Trainer)

        def training_step(self, model, inputs, num_items_in_batch=None):
            fed.append([rows[tuple(row.tolist())] for row in inputs["input_ids"]])
            plans.append(list(self.heterogeneous_engine().heterogeneous_plan.micro_batch_sizes))
            return super().training_step(model, inputs, num_items_in_batch)

    class OnDemandChange(TrainerCallback):

        def on_step_end(self, args, state, control, **kwargs):
            if change == "on_demand" and state.global_step == ON_DEMAND_STEP:
                trainer.heterogeneous_engine().reschedule_workload(utilization_metrics=ON_DEMAND_BUSY_SECONDS)

    args = TrainingArguments(output_dir=os.path.join(out, "trainer"),
                             per_device_train_batch_size=GLOBAL_BATCH // (world_size * gas),
                             per_device_eval_batch_size=EVAL_SAMPLES // world_size,
                             gradient_accumulation_steps=gas,
                             max_steps=steps,
                             learning_rate=LR,
                             lr_scheduler_type="constant",
                             weight_decay=0.0,
                             max_grad_norm=0.0,
                             seed=DATA_SEED,
                             average_tokens_across_devices=loss_kind == "global_mean",
                             deepspeed=ds_config(stage, change),
                             report_to=[],
                             save_strategy="steps" if save_at else "no",
                             save_steps=save_at or 500,
                             logging_strategy="no",
                             disable_tqdm=True,
                             use_cpu=True)
    trainer = RecordingTrainer(model=make_model(), args=args, train_dataset=TokenDataset(),
                               eval_dataset=TokenDataset(EVAL_SAMPLES), callbacks=[OnDemandChange()])
    checkpoint = os.path.join(out, "trainer", f"checkpoint-{save_at}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    # Evaluation keeps the Trainer's own equal shards (the engine checks training forwards only).
    eval_loss = trainer.evaluate()["eval_loss"]
    engine = trainer.heterogeneous_engine()
    rank = int(os.environ["RANK"])
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    torch.save({"fed": fed, "plans": plans, "eval_loss": eval_loss, "params": params},
               os.path.join(out, f"{loss_kind}-{gas}-{change}{'-resumed' if resume else ''}{'-stock' if stock else ''}"
                            f"-rank{rank}.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True, help="LOSS:GAS:CHANGE (see the docstring)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--stock", action="store_true",
                        help="the stock transformers.Trainer (equal batches, re-split by the engine)")
    parser.add_argument("--resume-at", type=int, default=None,
                        help="save a checkpoint at this step, then train again resumed from it")
    args = parser.parse_args()
    try:
        for case in args.case:
            train(case, args.out, args.steps, args.stage, save_at=args.resume_at, stock=args.stock)
            if args.resume_at:
                train(case, args.out, args.steps, args.stage, save_at=args.resume_at, resume=True, stock=args.stock)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
