# SPDX-License-Identifier: Apache-2.0
"""What a rank computes at each training forward: the rows it was fed, or its planned share of the
ranks' rows, and how its loss is weighted.

The plan gives rank i ``mbs_i`` samples per micro-step. The engine's loader and the fork's
samplers feed each rank its share; a stock loader feeds every rank alike. ``Feeding`` sees which at
each forward: every rank's way of feeding and fed size are gathered (one small all-gather, where
the ranks run their forwards together) and judged alike on every rank (``data/fed_batch.py``);
where the ranks were fed otherwise and re-splitting is on, the rows move to the planned shares
(``data/resplit.py``) and the outputs return to the ranks that were fed them. The loss's weight
follows what was computed, a caller's count of the items (``num_items_in_batch``) or the items a
loss averages over (``integrations/loss_normalization.py``).
"""

from ..data.fed_batch import fed_size, judge_feeding, leading_batch_size
from ..data.resplit import agree, resplit_inputs, return_outputs
from ..data.sampler import resume_sampler
from ..integrations.loss_normalization import LossWeighting


class Feeding:
    """One engine's feeding, built by its controller. ``exchange`` is the controller's
    ``ExchangeAccount`` (what re-splitting moved and cost); ``world`` the processes the ranks' loss
    counts are summed over."""

    def __init__(self, engine, state, exchange, world):
        self.engine = engine
        self.state = state
        self.settings = state.settings.config
        self.rank = state.dp_rank
        self.exchange = exchange
        self.world = world
        self.loss_weighting = LossWeighting(state, self.rank, world)
        self.samplers = []  # batch samplers that follow the plan (the engine's loader's, users' registered)
        self.deferred_sampler_states = []  # saved positions of samplers not registered when a checkpoint loaded
        self.engine_loader = False  # the engine's own loader (training_data=) feeds this rank
        self.check_fed_batch = self.settings.check_fed_batch
        self.fed = None  # the size of the micro-batch this rank computes (None: not known)
        self.split = None  # this micro-step's re-split (data.resplit.Split), None when nothing moved
        self.resplit = False  # the last training forward re-split what the ranks were fed (agreed by all)

    @property
    def plan(self):
        return self.state.plan

    @property
    def feeds_plan(self):
        """This rank's own view: the engine's loader or a registered heterogeneous sampler feeds it."""
        return bool(self.engine_loader or self.samplers)

    def restore_deferred_sampler(self, sampler, index):
        """Resume a sampler registered after the checkpoint was loaded at its saved position (the
        ``index``-th registered takes the ``index``-th saved)."""
        if index < len(self.deferred_sampler_states):
            resume_sampler(sampler, self.deferred_sampler_states[index], index)

    def begin(self, inputs, kwargs):
        """A training forward begins: the ``(inputs, kwargs)`` the model computes."""
        self.split = None
        self.loss_weighting.begin_forward()
        self.exchange.begin_micro_step()
        if self.state.pipeline is not None or self.plan.per_rank_gas:
            # No collective here where the ranks do not run their forwards together: a pipeline's
            # stages run them at different times, and per-rank gas gives the ranks different
            # numbers of them. The pipeline engine's own loader, and the engine's loader that per-rank
            # gas requires, feed each rank its plan.
            self.resplit = False
            self.fed = fed_size(self.plan, self.rank, inputs, kwargs, engine_loader=self.engine_loader,
                                check=self.check_fed_batch)
        else:
            self.resplit = self._agree(inputs, kwargs)
        if self.resplit:
            planned = self.plan.micro_batch_sizes
            inputs, kwargs, self.split = resplit_inputs(tuple(inputs), dict(kwargs or {}), planned, self.rank,
                                                        pad_token_id=self._pad_token_id(), clock=self.exchange.clock)
            self.fed = planned[self.rank]
            self.exchange.resplit(None if self.split is None else self.split.received_bytes((inputs, kwargs)))
        # Some rank was given a caller's count of the items its loss may divide by (the Trainer's
        # num_items_in_batch, counted over what was fed, passed through unchanged): whether the loss
        # really divides by it is seen as the model computes it, and the weight follows at the
        # forward's end, re-split or not.
        self.loss_weighting.watch(self.engine.module, kwargs)
        if self.settings.loss_items is not None:
            self.loss_weighting.weigh_items(self.settings.loss_items, inputs, kwargs)
        return inputs, kwargs

    def _agree(self, inputs, kwargs):
        """Every rank's data-parallel rank, way of feeding and fed size (kept as ``fed``), gathered
        at this forward, and what they imply for all of them alike: whether to re-split, or the
        error every rank raises. Rank-local facts (a sampler registered on one rank only, one rank
        fed the wrong size) would otherwise send the ranks down different paths: one waiting in a
        collective the others never enter."""
        fed = self.fed = leading_batch_size(inputs, kwargs or {}) if self.check_fed_batch else None
        count_given = (kwargs or {}).get("num_items_in_batch") is not None
        everyone = agree(self.rank, int(self.feeds_plan), -1 if fed is None else fed, int(count_given))
        # Whether some rank's loss may divide by a caller's count: the forward's end then agrees on it.
        # Not where the plan's own sampler feeds the ranks: HeterogeneousTrainer weighs those itself.
        self.loss_weighting.count_given = any(row[3] for row in everyone) and not any(row[1] for row in everyone)
        return judge_feeding(self.plan, [row[:3] for row in everyone], self.settings.resplit_fed_batches,
                             self.check_fed_batch, self.world == self.plan.world_size)

    def end_forward(self, outputs):
        """The forward's outputs as the caller gets them: after a re-split, every batch-first output
        returns to the rank that was fed its sample. Every loss is weighted by the rows this rank
        computed, as the plan says; a loss over the returned outputs is a loss over what the rank
        was fed, and the exchange's backward rescales their gradient by fed / computed rows, so it
        counts as such (whatever arithmetic or backward style follows). A forward given
        ``num_items_in_batch`` (the Trainer's count of the fed items) whose loss divides by it is
        weighted by the count's share of the ranks' sum (``LossWeighting``), and the returned rows'
        gradient is not rescaled."""
        self.loss_weighting.end_forward(self.engine.module, items_weighted=self.settings.loss_items is not None)
        split = self.split
        if split is None or not self.settings.return_outputs:
            return outputs
        scale = 1.0 if self.loss_weighting.caller_counts else split.fed[split.rank] / split.planned[split.rank]
        returned = return_outputs(outputs, split, scale, clock=self.exchange.clock)
        self.exchange.returned(split.received_bytes(returned, outputs=True))
        return returned

    def end_micro_step(self):
        """The micro-step's backward is done: the loss weight returns to the plan's."""
        self.state.weight_override = None
        self.exchange.end_micro_step(moved=self.split is not None)
        self.split = None

    def _pad_token_id(self):
        """The model's padding token (a transformers model's ``config.pad_token_id``), which pads
        ``input_ids`` when the ranks' sequence lengths differ; None: 0."""
        config = getattr(getattr(self.engine, "module", None), "config", None)
        value = getattr(config, "pad_token_id", None)
        return value if isinstance(value, int) else None
