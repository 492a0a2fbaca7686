# SPDX-License-Identifier: Apache-2.0
"""Hugging Face ``transformers.Trainer`` with ``heterogeneous_config``: each rank its planned micro-batch.

``TrainingArguments(deepspeed=ds_config)`` alone does not get there. The Trainer builds its train
loader before the DeepSpeed engine, and so the plan, exists; Accelerate then wraps that loader in
a ``DataLoaderShard``, which reads one batch ahead (a plan adopted at a step boundary would reach
the loader one step late), around a ``BatchSamplerShard`` that deals equal batches. And the
Trainer's default causal-LM loss is already normalised over the whole global batch, so the fork's
loss weight would count each rank's share twice. This module:

- builds the train loader on a ``HeterogeneousBatchSampler`` (rank r takes its mbs_r of every
  round of the epoch's permutation), unwrapped and loading in the main process, with provisional
  equal sizes whose round size is the plan's (``train_batch_size / gas``), so that the loader's
  length, which the Trainer reads first to count its steps, is what the plan will give;
- hands the sampler to the engine when training begins (``engine.register_heterogeneous_sampler``),
  before the first batch is drawn: from then on it serves the plan in force and every change of it;
- leaves the fork's loss weight out of the gradient where the Trainer's loss is already a mean
  over the global batch (``average_tokens_across_devices`` with a model that takes
  ``num_items_in_batch``); the loss value, which the Trainer logs, is not touched.

transformers is imported only when ``HeterogeneousTrainer`` is first used: this module imports
without it. ``HeterogeneousTrainerMixin`` goes in front of any Trainer subclass
(``class MyTrainer(HeterogeneousTrainerMixin, SFTTrainer)``). Without heterogeneous_config (or
without DeepSpeed) the Trainer behaves as it does upstream.
"""

from torch.utils.data import DataLoader, IterableDataset

from deepspeed.utils import logger

from ..config.settings import STRATEGIES, load_heterogeneous_settings
from ..data.sampler import HeterogeneousBatchSampler

# HeterogeneousTrainer is left out: a star import must not need transformers.
__all__ = ["HeterogeneousTrainerMixin", "HeterogeneousTrainerLoader", "provisional_micro_batch_sizes",
           "round_size_for_trainer", "check_trainer_plan"]


def heterogeneous_enabled(ds_config):
    """Whether ``ds_config`` (a dict) turns the fork on, as the engine will read it (environment
    switches included). A top-level ``"scheduler"`` of a load-balancing type is refused: with the
    Trainer that key is the learning-rate scheduler's, and Accelerate would build one for it."""
    scheduler = ds_config.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type") in STRATEGIES:
        raise ValueError(f"DeepSpeed config: the top-level 'scheduler' of type {scheduler.get('type')!r} is the "
                         "learning-rate scheduler's key to transformers.Trainer; move it to "
                         "heterogeneous_config.scheduler")
    return load_heterogeneous_settings(dict(ds_config)).config.enabled


def round_size_for_trainer(ds_config, gradient_accumulation_steps):
    """Samples per round (one global micro-step): ``train_batch_size / gas`` of the config the
    Trainer filled in. Every plan has this round size, whatever its split."""
    train_batch_size = ds_config.get("train_batch_size")
    if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1:
        raise ValueError(f"DeepSpeed config: train_batch_size = {train_batch_size!r}; heterogeneous_config with "
                         "transformers.Trainer needs the global batch: an integer, or \"auto\" for "
                         "per_device_train_batch_size * world_size * gradient_accumulation_steps")
    gas = gradient_accumulation_steps
    if train_batch_size % gas:
        raise ValueError(f"DeepSpeed config: train_batch_size {train_batch_size} is not a multiple of "
                         f"gradient_accumulation_steps {gas}; every micro-step takes train_batch_size / gas samples "
                         "across the ranks")
    return train_batch_size // gas


def provisional_micro_batch_sizes(round_size, world_size):
    """An equal split of ``round_size`` over ``world_size`` ranks (the first ranks take the remainder).

    It only stands in until the engine exists: it has the plan's round size, so the sampler's
    length and step count are already the plan's, and it is replaced before any batch is drawn."""
    if round_size < world_size:
        raise ValueError(f"train_batch_size / gradient_accumulation_steps = {round_size} samples per micro-step "
                         f"cannot give each of {world_size} data-parallel ranks at least one sample")
    base, extra = divmod(round_size, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def check_trainer_plan(plan, trainer_gas):
    """The Trainer runs ``trainer_gas`` micro-steps per optimizer step on every rank: refuse a plan
    that gives ranks their own accumulation (the ranks would disagree on the step boundary)."""
    if plan is None:
        return
    if set(plan.gradient_accumulation_steps) != {trainer_gas}:
        raise RuntimeError(f"the heterogeneous plan's gradient accumulation {list(plan.gradient_accumulation_steps)} "
                           f"differs from the Trainer's gradient_accumulation_steps {trainer_gas} on some rank: "
                           "transformers.Trainer runs the same number of micro-steps on every rank. The fork plans "
                           "per-rank gas only under ZeRO stage 0/1 (mostly where memory caps bound a rank's "
                           "micro-batch); use ZeRO stage 2 or 3 to rule it out")


def loss_is_global_mean(trainer, num_items_in_batch):
    """Whether the Trainer's loss is already normalised over the global batch: it divides by the
    token count summed over every rank and multiplies by the number of processes, so that the
    ranks' average gradient is the global mean for any split of the batch. Mirrors the condition
    in ``Trainer.compute_loss``."""
    return bool(trainer.args.average_tokens_across_devices
                and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
                and num_items_in_batch is not None)


def exclude_loss_weight(loss, weight):
    """``loss`` with its gradient divided by ``weight``: the engine multiplies the loss it is given
    by the rank's weight at backward, and a loss that is already a global mean must keep its own
    gradient. The value (what the Trainer logs) stays as it is."""
    if weight != 1.0 and loss.requires_grad:
        loss.register_hook(lambda grad: grad / weight)
    return loss


class HeterogeneousTrainerLoader(DataLoader):
    """The Trainer's train loader: batches from a ``HeterogeneousBatchSampler``, loaded in the main
    process, so that the sampler reads the plan in force when each micro-batch is drawn.
    ``set_epoch`` (which the Trainer calls at each epoch's start) reshuffles the sampler."""

    def set_epoch(self, epoch):
        self.batch_sampler.set_epoch(epoch)


class HeterogeneousTrainerMixin:
    """Goes in front of ``transformers.Trainer`` or a subclass of it (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.heterogeneous_sampler = None
        self._heterogeneous = self.is_deepspeed_enabled and heterogeneous_enabled(self._ds_config())
        if self._heterogeneous:
            if self.args.auto_find_batch_size:
                raise ValueError("TrainingArguments.auto_find_batch_size is not supported with heterogeneous_config: "
                                 "the plan sets every rank's micro-batch")
            self.add_callback(_plan_follower(self))

    def _ds_config(self):
        return self.accelerator.state.deepspeed_plugin.hf_ds_config.config

    def heterogeneous_engine(self):
        """The DeepSpeed engine once training has begun (None before)."""
        engine = self.model_wrapped
        return engine if hasattr(engine, "heterogeneous_plan") else None

    def get_train_dataloader(self):
        if not self._heterogeneous:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("heterogeneous_config needs a map-style train_dataset with a length: the heterogeneous "
                             "sampler deals each rank its share of every round of the epoch's permutation")
        if self.args.dataloader_num_workers:
            logger.warning(f"dataloader_num_workers={self.args.dataloader_num_workers} ignored with "
                           "heterogeneous_config: the train loader loads in the main process, so that a new plan "
                           "applies from the very next step")
        collator = self.data_collator
        if _is_datasets_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        gas = self.args.gradient_accumulation_steps
        sizes = provisional_micro_batch_sizes(round_size_for_trainer(self._ds_config(), gas), self.args.world_size)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self.heterogeneous_sampler = HeterogeneousBatchSampler(dataset, sizes, rank=self.args.process_index,
                                                               shuffle=True, seed=seed,
                                                               drop_last=self.args.dataloader_drop_last)
        return HeterogeneousTrainerLoader(dataset, batch_sampler=self.heterogeneous_sampler, collate_fn=collator,
                                          num_workers=0, pin_memory=self.args.dataloader_pin_memory)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        engine = self.heterogeneous_engine() if self._heterogeneous else None
        if engine is not None and model.training and loss_is_global_mean(self, num_items_in_batch):
            loss = result[0] if return_outputs else result
            exclude_loss_weight(loss, engine.heterogeneous_state.loss_weight)
        return result


def _is_datasets_dataset(dataset):
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _plan_follower(trainer):
    """A callback that hands the trainer's sampler to the engine when training begins and checks
    every plan in force against the Trainer's fixed accumulation."""
    from transformers import TrainerCallback

    class HeterogeneousPlanFollower(TrainerCallback):

        def on_train_begin(self, args, state, control, **kwargs):
            engine = trainer.heterogeneous_engine()
            if engine is None:
                raise RuntimeError("heterogeneous_config: training began without a DeepSpeed engine")
            if trainer.heterogeneous_sampler is not None:
                engine.register_heterogeneous_sampler(trainer.heterogeneous_sampler)
                if engine._heterogeneous_runtime().deferred_sampler_states:
                    # The checkpoint put the sampler at its saved position (resume_from_checkpoint):
                    # the Trainer must not skip the epoch's first batches a second time.
                    args.ignore_data_skip = True
            check_trainer_plan(engine.heterogeneous_plan, args.gradient_accumulation_steps)

        def on_step_end(self, args, state, control, **kwargs):
            # A plan is adopted on every rank at the same boundary, so every rank raises together.
            check_trainer_plan(trainer.heterogeneous_engine().heterogeneous_plan, args.gradient_accumulation_steps)

    return HeterogeneousPlanFollower()


_TRAINER_CLASS = None


def __getattr__(name):
    # HeterogeneousTrainer subclasses transformers.Trainer: built on first use, so that importing
    # this module needs no transformers.
    global _TRAINER_CLASS
    if name != "HeterogeneousTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _TRAINER_CLASS is None:
        from transformers import Trainer
        _TRAINER_CLASS = type("HeterogeneousTrainer", (HeterogeneousTrainerMixin, Trainer), {
            "__module__": __name__,
            "__doc__": "``transformers.Trainer`` whose ranks train on the heterogeneous plan's micro-batches."
        })
    return _TRAINER_CLASS
