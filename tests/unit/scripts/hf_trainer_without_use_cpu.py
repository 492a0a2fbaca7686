# SPDX-License-Identifier: Apache-2.0
"""The stock transformers Trainer under the deepspeed launcher on a machine without a GPU, as a new
user writes it: ``TrainingArguments`` without ``use_cpu=True``. accelerate then finds no
distributed backend and counts one process; the fork must stop every rank with one line that says
so (test_hf_trainer.py). ``--use-cpu`` passes it, and training runs."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):

    def __len__(self):
        return 32

    def __getitem__(self, index):
        ids = torch.randint(0, 64, (8, ), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def main():
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
              "heterogeneous_config": {"enabled": True}}
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir="hf_out", per_device_train_batch_size=4, max_steps=2, report_to=[],
                             deepspeed=config, save_strategy="no", disable_tqdm=True,
                             **({"use_cpu": True} if "--use-cpu" in sys.argv else {}))
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
    # Past the work, without interpreter finalization, where gloo's threads can abort a rank
    # ("terminate called without an active exception"; seen once in a full CI run).
    from deepspeed.runtime.heterogeneous.process_exit import end_process
    end_process(0)
