# SPDX-License-Identifier: Apache-2.0
"""transformers.Trainer with heterogeneous_config, run by tests/unit/heterogeneous/test_hf_trainer.py
under the deepspeed launcher.

Trains a tiny GPT-2 (built from a config, no download) once per case given on the command line,
each with a fresh Trainer and engine, and writes per rank what it fed the model at every
micro-step (dataset indices), the plan in force then, the trained parameters and the evaluation
loss, to ``<out>/<loss>-<gas>-<change>-rank<r>.pt``. The test replays the same global batches in
one process. A case is ``[MODEL/]LOSS:GAS:CHANGE[:OPTIMIZER]``:

- MODEL ``gpt2`` (the default, or ``--model``): a causal LM, whose loss divides by the Trainer's
  ``num_items_in_batch``; ``bert``: a sequence classifier, whose loss is a mean over its own rows
  (it ignores the count the Trainer passes it). Its results are named ``bert-<loss>-...``.
- LOSS ``global_mean``: the Trainer's default for a causal LM (loss over the global batch's token
  count); ``rank_mean``: average_tokens_across_devices=False (each rank's own mean).
- CHANGE ``profiling``: rank 1 emulated at a tenth of rank 0's speed (time dilation) and 3
  profiling steps, which re-plan from what they measure (the outcome depends on the timings);
  ``on_demand``: no profiling, and ``engine.reschedule_workload`` with rank 1 three times slower
  at the end of step 2, a certain change to [12, 4]; ``manual=A,B``: the manual split [A, B].
- OPTIMIZER ``adam`` (the default) or ``sgd``: plain SGD at ``SGD_LR``, whose update is proportional
  to the gradient, so that a wrong factor on a loss shows in the parameters (Adam's update is
  nearly blind to a constant one). Its results end in ``-sgd``.

    deepspeed --num_gpus 2 tests/unit/scripts/hf_trainer_train.py --out DIR --case global_mean:1:on_demand

With ``--resume-at K`` each case also saves a checkpoint at step K and then trains again, a new
Trainer resumed from that checkpoint, to ``<loss>-<gas>-<change>-resumed-rank<r>.pt`` (its
``fed`` and ``plans`` from step K + 1 on).
"""

import argparse
import copy
import os

import torch

DATASET = 64
SEQUENCE = 16
VOCAB = 64
GLOBAL_BATCH = 16
LR = 1e-4
# Large enough that 8 steps move the parameters ~2e-2, four orders of magnitude above the test's tolerance.
SGD_LR = 0.1
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


def make_classifier():
    """A BERT sequence classifier: its head computes a mean over its own rows and ignores the
    num_items_in_batch the Trainer passes it."""
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                        vocab_size=VOCAB, max_position_embeddings=SEQUENCE, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=CLASSES, type_vocab_size=1)
    torch.manual_seed(MODEL_SEED)
    return BertForSequenceClassification(config)


MODELS = {"gpt2": make_model, "bert": make_classifier}
CLASSES = 3


def tokens():
    """Every sample's token ids (distinct rows, so that a fed row names its sample)."""
    return torch.randint(0, VOCAB, (DATASET, SEQUENCE), generator=torch.Generator().manual_seed(3))


def labels_of(model_name, ids):
    """The training labels of ``ids`` (rows of ``tokens()``): the tokens themselves for the causal
    LM, a class per row for the classifier."""
    if model_name == "bert":
        return ids.sum(dim=-1) % CLASSES
    # The first (sum of the row's ids) % 4 labels are -100: the rows' token counts differ, so a
    # rank's row count is not what its loss divides by.
    labels = ids.clone()
    masked = (ids.sum(dim=-1, keepdim=True) % 4) > torch.arange(ids.shape[1])
    labels[masked] = -100
    return labels


EVAL_SAMPLES = 16


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self, size=DATASET, model_name="gpt2"):
        self.ids = tokens()[:size]
        self.labels = labels_of(model_name, self.ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index].clone()}


ON_DEMAND_STEP = 2
ON_DEMAND_BUSY_SECONDS = [1.0, 3.0]


OPTIMIZERS = {
    "adam": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                        "torch_adam": True}},
    "sgd": {"type": "SGD", "params": {"lr": "auto"}},  # torch.optim.SGD: no momentum, no weight decay
}


def split_case(case):
    """``LOSS:GAS:CHANGE[:OPTIMIZER]`` as (loss, gas, change, optimizer)."""
    loss_kind, gas, change, *optimizer = case.split(":")
    return loss_kind, gas, change, optimizer[0] if optimizer else "adam"


def ds_config(stage, change, optimizer="adam"):
    heterogeneous = {"enabled": True, "load_balancing_strategy": "compute_aware"}
    if change == "profiling":
        heterogeneous.update(profile_steps=3, emulation={"speeds": [1.0, 0.1], "mode": "dilation"})
    elif change == "on_demand":
        heterogeneous.update(profile_steps=0)
    elif change.startswith("manual="):
        heterogeneous.update(load_balancing_strategy="manual",
                             micro_batch_sizes=[int(size) for size in change[len("manual="):].split(",")])
    else:
        raise SystemExit(f"unknown plan change {change!r}: profiling, on_demand or manual=A,B")
    return {
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": copy.deepcopy(OPTIMIZERS[optimizer]),
        # ZeRO takes only the optimizers it tested unless told (SGD keeps no state to partition).
        "zero_allow_untested_optimizer": optimizer != "adam",
        "heterogeneous_config": heterogeneous,
    }


def result_name(model_name, case, resume=False, stock=False):
    loss_kind, gas, change, optimizer = split_case(case)
    prefix = "" if model_name == "gpt2" else f"{model_name}-"
    return (f"{prefix}{loss_kind}-{gas}-{change}{'-resumed' if resume else ''}{'-stock' if stock else ''}"
            f"{'' if optimizer == 'adam' else '-' + optimizer}-rank{{rank}}.pt")


def train(case, out, steps, stage, save_at=None, resume=False, stock=False, model_name="gpt2"):
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from deepspeed.runtime.heterogeneous.integrations.hf_trainer import HeterogeneousTrainer

    loss_kind, gas, change, optimizer = split_case(case)
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
                             learning_rate=SGD_LR if optimizer == "sgd" else LR,
                             lr_scheduler_type="constant",
                             weight_decay=0.0,
                             max_grad_norm=0.0,
                             seed=DATA_SEED,
                             average_tokens_across_devices=loss_kind == "global_mean",
                             deepspeed=ds_config(stage, change, optimizer),
                             report_to=[],
                             save_strategy="steps" if save_at else "no",
                             save_steps=save_at or 500,
                             logging_strategy="no",
                             disable_tqdm=True,
                             use_cpu=True)
    trainer = RecordingTrainer(model=MODELS[model_name](), args=args, train_dataset=TokenDataset(model_name=model_name),
                               eval_dataset=TokenDataset(EVAL_SAMPLES, model_name), callbacks=[OnDemandChange()])
    checkpoint = os.path.join(out, "trainer", f"checkpoint-{save_at}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    # Evaluation keeps the Trainer's own equal shards (the engine checks training forwards only).
    eval_loss = trainer.evaluate()["eval_loss"]
    engine = trainer.heterogeneous_engine()
    rank = int(os.environ["RANK"])
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    torch.save({"fed": fed, "plans": plans, "eval_loss": eval_loss, "params": params},
               os.path.join(out, result_name(model_name, case, resume, stock).format(rank=rank)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True,
                        help="LOSS:GAS:CHANGE[:OPTIMIZER] (see the docstring)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2",
                        help="gpt2: a causal LM (its loss divides by num_items_in_batch); bert: a sequence classifier")
    parser.add_argument("--stock", action="store_true",
                        help="the stock transformers.Trainer (equal batches, re-split by the engine)")
    parser.add_argument("--resume-at", type=int, default=None,
                        help="save a checkpoint at this step, then train again resumed from it")
    args = parser.parse_args()
    try:
        for spec in args.case:
            model_name, _, case = spec.rpartition("/")
            model_name = model_name or args.model
            train(case, args.out, args.steps, args.stage, save_at=args.resume_at, stock=args.stock,
                  model_name=model_name)
            if args.resume_at:
                train(case, args.out, args.steps, args.stage, save_at=args.resume_at, resume=True, stock=args.stock,
                      model_name=model_name)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
