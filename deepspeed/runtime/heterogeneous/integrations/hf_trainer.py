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

import torch
from torch.utils.data import DataLoader, IterableDataset

from deepspeed.utils import logger

from ..config.settings import load_heterogeneous_settings
from ..config.strategies import strategy_names
from ..data.fed_batch import leading_batch_size
from ..data.loss_items import count_items, items_weight
from ..data.sampler import HeterogeneousBatchSampler
from .loss_normalization import LossFunctionWatch, agreed_verdict, names_num_items, sum_over_ranks

# HeterogeneousTrainer is left out: a star import must not need transformers.
__all__ = ["HeterogeneousTrainerMixin", "HeterogeneousTrainerLoader", "provisional_micro_batch_sizes",
           "round_size_for_trainer", "check_trainer_plan", "agreed_loss_weight", "label_items"]


def heterogeneous_enabled(ds_config):
    """Whether ``ds_config`` (a dict) turns the fork on, as the engine will read it (environment
    switches included). A top-level ``"scheduler"`` of a load-balancing type is refused: with the
    Trainer that key is the learning-rate scheduler's, and Accelerate would build one for it."""
    scheduler = ds_config.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type") in strategy_names():
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


def label_items(inputs, shifts_labels):
    """The items this micro-batch's loss is a mean over when the model computes a plain mean: its
    labels that are not -100 (``shift_labels`` as given, else ``labels``, without position 0 where
    the loss shifts them), or its rows when it has no labels (a question-answering head's
    positions, for example)."""
    if "shift_labels" in inputs and isinstance(inputs["shift_labels"], torch.Tensor):
        return count_items(inputs["shift_labels"])
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        return count_items(labels, shift=shifts_labels and labels.dim() > 1)
    return leading_batch_size((), inputs) or 0


def agreed_loss_weight(mine, total, world_size, average_tokens_across_devices, fallback):
    """This rank's loss weight for one micro-step of the Trainer, from ``mine`` and ``total`` (its
    own and every rank's summed ``(items, num_items, honours, conclusive)``: label items of the
    micro-batch, the ``num_items_in_batch`` the Trainer passed (0: none), and whether the loss was
    seen dividing by it).

    - The loss divides by ``num_items_in_batch`` (every rank that could tell saw it; the Trainer's
      belief when none could): with ``average_tokens_across_devices`` the count is already global
      and the Trainer has multiplied by the number of processes, so the ranks' plain average is
      the global mean: weight 1. Without, each rank divided by its own count: weighted by it.
    - Otherwise the loss is a mean over the micro-batch's own items (a classifier's rows, a
      tagger's labelled tokens): weighted by them (``data/loss_items.py``).
    """
    items, num_items = mine[0], mine[1]
    total_items, total_num_items, honours, conclusive = total
    if num_items > 0 and honours == conclusive:
        if average_tokens_across_devices:
            return 1.0
        return items_weight(world_size, num_items, total_num_items, fallback)
    return items_weight(world_size, items, total_items, fallback)


class HeterogeneousTrainerLoader(DataLoader):
    """The Trainer's train loader: batches from a ``HeterogeneousBatchSampler``, loaded in the main
    process, so that the sampler reads the plan in force when each micro-batch is drawn.
    ``set_epoch`` (which the Trainer calls at each epoch's start) reshuffles the sampler."""

    def set_epoch(self, epoch):
        self.batch_sampler.set_epoch(epoch)


class HeterogeneousTrainerMixin:
    """Goes in front of ``transformers.Trainer`` or a subclass of it (see the module docstring)."""

    def __init__(self, *args, loss_uses_num_items=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_uses_num_items = loss_uses_num_items
        self._loss_watch = LossFunctionWatch()
        self.heterogeneous_sampler = None
        self._heterogeneous = self.is_deepspeed_enabled and heterogeneous_enabled(self._ds_config())
        if self._heterogeneous:
            if self.args.auto_find_batch_size:
                raise ValueError("TrainingArguments.auto_find_batch_size is not supported with heterogeneous_config: "
                                 "the plan sets every rank's micro-batch")
            if load_heterogeneous_settings(dict(self._ds_config())).config.resplit_fed_batches is True:
                # The sampler already feeds the plan, and the loss's items are counted in what was fed.
                raise ValueError("heterogeneous_config.resplit_fed_batches true is not supported with "
                                 "HeterogeneousTrainer: its sampler feeds each rank its planned share, so nothing "
                                 "needs re-splitting; set it to \"auto\" (or use the stock Trainer, which it serves)")
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
        engine = self.heterogeneous_engine() if self._heterogeneous else None
        if engine is None or not model.training or engine.heterogeneous_plan is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # Counted before the Trainer pops the labels for a compute_loss_func.
        items = label_items(inputs, getattr(self, "_loss_shifts_labels", False))
        self._loss_watch.start(engine.module)
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        finally:
            seen = self._loss_watch.stop()
        honours = self._loss_honours_num_items(engine.module, seen)
        # The count reaches the loss only through the model's kwargs or a compute_loss_func.
        passed = num_items_in_batch is not None and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
        num_items = float(num_items_in_batch) if passed else 0.0
        mine = [float(items), num_items, float(honours is True), float(honours is not None)]
        # Every rank, every training micro-step: one collective whatever this rank found.
        runtime = engine._heterogeneous_runtime()
        total = sum_over_ranks(mine)
        self._loss_watch.settle(agreed_verdict(total[2], total[3]))
        state = engine.heterogeneous_state
        fallback = state.plan.loss_weights[state.dp_rank]
        state.weight_override = agreed_loss_weight(mine, total, runtime.process_count,
                                                   self.args.average_tokens_across_devices, fallback)
        return result

    def _loss_honours_num_items(self, module, seen):
        """Whether this micro-step's loss divided by ``num_items_in_batch``: the user's declaration
        (``loss_uses_num_items``), else a ``compute_loss_func`` does (the Trainer's contract for it),
        else what the watch saw the transformers model's loss function do (None: it could not
        tell), else whether a model of another kind names the parameter."""
        if self.loss_uses_num_items is not None:
            return bool(self.loss_uses_num_items)
        if self.compute_loss_func is not None:
            return True
        if self._loss_watch.watches(module):
            return seen
        return names_num_items(module)


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
                if engine._heterogeneous_runtime().feeding.deferred_sampler_states:
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
