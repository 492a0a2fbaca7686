# SPDX-License-Identifier: Apache-2.0
"""Whether a Hugging Face model's loss is divided by the ``num_items_in_batch`` it is given.

``transformers.Trainer`` counts the labelled items of a step (over every rank with
``average_tokens_across_devices``) and passes the count to any model whose ``forward`` takes
``**kwargs``, then treats the loss as normalised by it: it multiplies it by the number of processes
and does not divide it by the accumulation steps. Whether the model really divides by the count is
another matter. A causal LM's ``ForCausalLMLoss`` does; ``BertForSequenceClassification`` computes
its own ``CrossEntropyLoss()`` and never sees the count; the generic sequence-classification loss
honours it for single-label classification and ignores it for regression and multi-label heads.
Neither a model's signature nor its loss function's tells, so the fork finds out by watching:

- ``LossFunctionWatch`` replaces the model's ``loss_function`` (a settable property of every
  ``PreTrainedModel``) for the duration of one forward and records each call. A model that
  computes its loss inline makes no call: its loss ignores the count.
- A call given a count is repeated on detached inputs with twice the count: a loss that halves
  divides by it, one that stays ignores it (``honours_num_items``). A loss that is zero or not
  finite tells nothing. The ranks agree on what their calls showed (a small all-reduce, by the
  caller), and the agreed verdict is kept for the loss function (``settle``): it is not probed again.

The repeat costs one more evaluation of the loss function, without autograd, until the ranks have
agreed: usually once per run. It holds the loss function's temporaries (a causal LM's logits in
fp32) a second time at that step.
"""

import math

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from ..data.fed_batch import raised_on_every_rank
from ..data.loss_items import count_items, items_weight, select_input

__all__ = ["LossFunctionWatch", "LossWeighting", "loss_function_owner", "honours_num_items", "names_num_items",
           "agreed_verdict", "sum_over_ranks"]


def loss_function_owner(module):
    """The outermost submodule of ``module`` (itself included) whose class has a ``loss_function``
    property: a transformers ``PreTrainedModel`` (a PEFT wrapper's base model, a DeepSpeed engine's
    module). Its forward is the one that calls ``self.loss_function``. None for other models."""
    for candidate in module.modules():
        declared = getattr(type(candidate), "loss_function", None)
        if isinstance(declared, property) and declared.fset is not None:
            return candidate
    return None


def names_num_items(module):
    """Whether ``module.forward`` names a ``num_items_in_batch`` parameter (not only ``**kwargs``):
    a model that is not a transformers model and asks for the count by name is taken to divide by it."""
    import inspect
    try:
        return "num_items_in_batch" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def honours_num_items(function, args, kwargs, result):
    """True when ``function`` (called with ``args``/``kwargs``, which hold ``num_items_in_batch``, and
    returning ``result``) divides by the count; False when its value does not depend on it; None
    when the result tells nothing (zero, not finite, not a scalar)."""
    count = kwargs.get("num_items_in_batch")
    if count is None:
        return False  # the model did not hand the count to its loss
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        return None
    # Called again whatever the first value, so that every rank makes the same calls: a loss
    # function may run collectives of its own (a vocabulary-parallel cross-entropy).
    with torch.no_grad():
        again = function(*_detached(args), **{**_detached(kwargs), "num_items_in_batch": count * 2})
    value, doubled = float(result.detach().float()), float(again.detach().float())
    if value == 0.0 or doubled == 0.0 or not math.isfinite(value) or not math.isfinite(doubled):
        return None
    ratio = value / doubled
    if abs(ratio - 2.0) < 1e-3:
        return True
    if abs(ratio - 1.0) < 1e-3:
        return False
    return None


def agreed_verdict(honours, conclusive):
    """What the ranks' loss functions showed together, from the number of ranks whose calls showed
    it dividing by the count (``honours``) and whose calls told anything (``conclusive``): True when
    every rank that could tell saw it divide, False when one saw it ignore the count, None when no
    rank could tell."""
    if not conclusive:
        return None
    return honours == conclusive


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    return value


class LossFunctionWatch:
    """Watches one forward's calls of a transformers model's ``loss_function``.

    ``start(module)`` before the forward, ``stop()`` after it (also when it failed: the model's
    own loss function is put back). ``stop`` returns what the calls showed: True when every call
    divided by ``num_items_in_batch`` (calls that told nothing aside), False when one did not or the
    model made no call (an inline loss, or not a transformers model), None when the calls told
    nothing. Verdicts are kept per loss function for the watch's lifetime."""

    def __init__(self):
        self._verdicts = {}
        self._owners = {}  # id(module) -> its loss_function owner: found once, not at every forward
        self._owner = None
        self._function = None  # the loss function watched at the last start
        self._had_own = False
        self._own = None
        self._calls = []

    def start(self, module):
        self.stop()
        self._function = None
        if id(module) not in self._owners:
            self._owners[id(module)] = loss_function_owner(module)
        owner = self._owners[id(module)]
        if owner is None:
            return
        self._owner, self._calls = owner, []
        self._had_own = "_loss_function" in owner.__dict__
        self._own = owner.__dict__.get("_loss_function")
        original = self._function = owner.loss_function
        calls, verdicts = self._calls, self._verdicts

        def watched(*args, **kwargs):
            result = original(*args, **kwargs)
            known = verdicts.get(original)
            calls.append(honours_num_items(original, args, kwargs, result) if known is None else known)
            return result

        owner.loss_function = watched

    def watches(self, module):
        """Whether ``start(module)`` watched a transformers model's loss function (False: the module
        has none, and what its loss does with the count is not seen)."""
        return self._owners.get(id(module)) is not None

    def settle(self, verdict):
        """Keep ``verdict`` (True or False: what every rank agreed the last forward's loss showed)
        for the loss function watched then, so that no rank probes it again (unsettled, every rank
        probes at its next call)."""
        if verdict is not None and self._function is not None:
            self._verdicts[self._function] = bool(verdict)

    def stop(self):
        owner, calls = self._owner, self._calls
        if owner is None:
            return False
        if self._had_own:
            owner.loss_function = self._own
        else:
            owner.__dict__.pop("_loss_function", None)
        self._owner, self._calls = None, []
        if not calls or any(call is False for call in calls):
            return False
        return True if any(call is True for call in calls) else None


def sum_over_ranks(values):
    """``values`` (numbers) summed over every process: a collective that every rank must call at
    the same point. Used for the counts that a loss is normalised by."""
    tensor = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


class LossWeighting:
    """This rank's loss weight where the loss is not a mean over the rows it computed, decided
    alike on every rank at each training forward (the runtime controller keeps one):

    - a loss that is a mean over the items of one input (``heterogeneous_config.loss_items``): the
      rank's items over every rank's (``items_weight``, one all-reduce per forward);
    - a forward given the caller's ``num_items_in_batch`` (the Trainer's count of the items it fed):
      whether the loss divides by it is watched as the model computes it (``LossFunctionWatch``),
      the ranks agree on it at the forward's end (one all-reduce), and a loss that divides by a
      count taken over the fed rows is weighted by that count's share of their sum.

    ``state``: the fork's state, whose ``weight_override`` the engine's loss scaling reads;
    ``process_count``: the processes ``sum_over_ranks`` sums over."""

    def __init__(self, state, rank, process_count):
        self._state, self._rank, self.process_count = state, rank, process_count
        self._watch = LossFunctionWatch()
        self._watching = False
        self.count_given = False
        """Some rank's forward was given ``num_items_in_batch`` (agreed as the forward began)."""
        self.caller_counts = False
        """The loss divided by the caller's count: a loss over the fed rows, not the computed ones."""
        self._given = None

    def begin_forward(self):
        """A training forward begins: nothing carried over (a forward that raised after the watch
        began, and was caught, leaves the model's own loss function in place)."""
        self._state.weight_override = None
        if self._watching:
            self._watch.stop()
        self._watching = self.caller_counts = self.count_given = False

    def watch(self, module, kwargs):
        """With a caller's count on some rank, watch whether ``module``'s loss divides by it."""
        if self.count_given:
            self._given = (kwargs or {}).get("num_items_in_batch")
            self._watch.start(module)
            self._watching = True

    def weigh_items(self, spec, inputs, kwargs):
        """``heterogeneous_config.loss_items`` (``spec``): this forward's weight from the items of the
        named input, summed over every rank (every rank raises alike where one has no such tensor)."""
        value = select_input(inputs, kwargs, spec.input)
        items, missing = 0, 0.0
        if not isinstance(value, torch.Tensor):
            missing = 1.0  # counted in the collective, so that every rank raises below, none alone
        else:
            items = count_items(value, spec.ignore_index, spec.shift)
        total, absent = sum_over_ranks([float(items), missing])
        if absent:
            where = f"argument {spec.input}" if isinstance(spec.input, int) else f"keyword argument {spec.input!r}"
            raise raised_on_every_rank(ValueError(
                f"heterogeneous_config.loss_items.input: the training forward of {int(absent)} rank(s) had no tensor "
                f"{where}; name the forward argument whose items the loss averages (a keyword's name or a "
                f"positional index)"))
        self._state.weight_override = items_weight(self.process_count, items, total, self._plan_weight())

    def end_forward(self, module, items_weighted):
        """The forward ended: where a count was given on some rank (every rank is here alike), agree
        on whether the loss divided by it and on the counts (one small all-reduce); with
        ``items_weighted`` the items' weight stays."""
        if not self._watching:
            return
        self._watching = False
        seen = self._watch.stop()
        if not self._watch.watches(module):
            seen = names_num_items(module)  # not a transformers model: its signature says
        given = self._given
        count = float(given) if given is not None else 0.0
        total = sum_over_ranks([count, float(given is not None), float(seen is True), float(seen is not None)])
        verdict = agreed_verdict(total[2], total[3])
        self._watch.settle(verdict)
        # Told nothing anywhere (zero losses): the Trainer's own belief that the loss divides.
        self.caller_counts = total[1] > 0 and verdict is not False
        if self.caller_counts and not items_weighted:
            self._state.weight_override = items_weight(self.process_count, count, total[0], self._plan_weight())

    def _plan_weight(self):
        return self._state.plan.loss_weights[self._rank]
