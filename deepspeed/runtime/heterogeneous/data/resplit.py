# SPDX-License-Identifier: Apache-2.0
"""Re-splitting what the ranks were fed into what the plan gives them, and returning the outputs.

A stock loader (``DistributedSampler``, Accelerate's, the Trainer's) feeds every rank the same
number of samples; the plan gives rank r ``p_r``. Before the forward, the engine moves whole
samples so that each rank computes its planned share of the union of what was fed:

- The ranks' fed micro-batches, concatenated in data-parallel rank order, are one global
  micro-batch of ``N = sum(f)`` samples; rank r computes its rows ``[P_r, P_r + p_r)`` (``P_r``:
  the planned sizes before it). A rank keeps the rows it was fed that fall in its own range and
  receives the others, so only the surplus of a rank moves, always the same rows for the same
  sizes.
- Every tensor whose dim 0 is the fed size is batch-first and moves (positional and keyword
  arguments, nested dicts, lists and tuples: ``input_ids``, ``attention_mask``, ``labels``);
  anything else (scalars, ``num_items_in_batch``, a non-tensor) passes unchanged.
- Outputs return to the ranks that were fed their samples (``return_outputs``): every batch-first
  output is exchanged back through a differentiable exchange, so ``engine(x)[i]`` belongs to the
  caller's ``x[i]`` and a loss computed outside the model pairs outputs with the right labels.
  Its backward sends each output's gradient to the rank that computed it (one all-reduce of the
  global micro-batch's rows for all outputs, zeros except the rows a rank was fed: exact),
  rescaled by fed / computed rows so that a loss over the returned rows counts by what the rank
  was fed. Scalar outputs (a loss computed inside the forward) stay the rank's own: a loss over
  the samples it computed, weighted by those. Every rank's backward must reach some returned
  output (the exchange's backward is a collective); which ones may differ.

- Dynamic padding (each rank's batch padded to its own longest sequence) is padded further, on
  the right, to the longest of all ranks, when every tensor whose length differs sits in a
  mapping with an ``attention_mask``: the mask is padded with 0, ``labels`` with -100 (which
  transformers' losses ignore), every other sequence tensor with 0. A model that honours its
  attention mask computes the same values for the real tokens (a causal model never looks right;
  a bidirectional one gives the padded keys no weight), so the result is unchanged; the returned
  outputs are cut back to the caller's length. Without an attention mask, lengths that differ
  stop every rank with one message.

Every rank runs the same collectives: one gather of two numbers per micro-step (the fed size, and
a checksum of the batch-first tensors: their number, structure, dtypes and trailing shapes, with
a sequence length beside an attention mask left out and carried above it), then, only where the fed
sizes differ from the plan, one all-gather per dtype of the batch-first inputs and one per dtype
of the outputs (their backward: one all-reduce per dtype). Structures that
differ between ranks (other than paddable lengths) stop every rank with one message, as does a
global micro-batch of another size than the plan's.

Which tensors of a nested batch move, and which may be padded, is ``batch_structure.py``'s.
"""

import math
import time
from dataclasses import dataclass

import torch

from deepspeed import comm as dist

from ..measure import comm_clock
from .batch_structure import _leading, _loose_checksum, _pad, _tensors, _walk, batch_first, sequence_tensors


class ResplitError(ValueError):
    """The ranks' fed micro-batches cannot be re-split into the plan (every rank raises it)."""


class ExchangeClock:
    """Seconds spent moving inputs and returning outputs (forward and backward), and the
    micro-steps that moved anything: what the planner weighs a plan's exchange by
    (``planning/exchange.py``). On an asynchronous device the times are those of the host."""

    def __init__(self):
        self.seconds = 0.0
        self.micro_steps = 0
        self.fed = None  # the ranks' fed sizes at the last forward (the same on every rank)
        self.per_micro_step = []  # (seconds, bytes received) of each micro-step that moved (the runtime's)

    @staticmethod
    def mark():
        return time.perf_counter(), comm_clock.seconds_dilated

    def timed(self, mark):
        """Add the time since ``mark()``, less what time dilation slept in it (the emulated compute
        of a slower device, which a real one would have finished before the exchange began)."""
        began, dilated = mark
        self.seconds += time.perf_counter() - began - (comm_clock.seconds_dilated - dilated)


@dataclass(frozen=True)
class Split:
    """One micro-step's re-split: what each data-parallel rank was fed and computes."""

    fed: tuple
    planned: tuple
    rank: int
    length: int = 0  # this rank's fed sequence length, when the inputs were padded to ``padded_length``
    padded_length: int = 0

    @property
    def needed(self):
        return tuple(self.fed) != tuple(self.planned)

    @staticmethod
    def _start(sizes, rank):
        return sum(sizes[:rank])

    def kept_rows(self, rank):
        """Rows rank ``rank`` was fed and computes itself."""
        f0, p0 = self._start(self.fed, rank), self._start(self.planned, rank)
        return max(0, min(f0 + self.fed[rank], p0 + self.planned[rank]) - max(f0, p0))

    def received_bytes(self, value, outputs=False):
        """Bytes of ``value``'s batch-first tensors (this rank's computed rows, or with ``outputs``
        its returned fed rows) that came from another rank."""
        rows = self.fed[self.rank] if outputs else self.planned[self.rank]
        received = rows - self.kept_rows(self.rank)
        total = 0

        def visit(_, tensor):
            nonlocal total
            if rows and tensor.dim() > 0 and int(tensor.shape[0]) == rows:
                total += tensor.element_size() * tensor.numel() // rows * received
            return tensor

        _walk(value, "", visit)
        return total

    def moved_rows(self):
        """Rows computed on another rank than the one fed them (summed over ranks)."""
        moved = 0
        for rank in range(len(self.fed)):
            f0, f1 = self._start(self.fed, rank), self._start(self.fed, rank) + self.fed[rank]
            p0, p1 = self._start(self.planned, rank), self._start(self.planned, rank) + self.planned[rank]
            moved += self.planned[rank] - max(0, min(f1, p1) - max(f0, p0))
        return moved


def agree(*numbers):
    """Every rank's ``numbers`` (a few integers: fed rows, checksums), gathered in one collective."""
    from deepspeed.accelerator import get_accelerator
    device = "cpu" if _gloo() else get_accelerator().current_device_name()
    mine = torch.tensor([int(n) for n in numbers], dtype=torch.long, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [tuple(int(v) for v in row.tolist()) for row in everyone]


def _gloo():
    import torch.distributed
    return torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"


def _rows_of_many(tensors, source_sizes, target_sizes, rank):
    """Rows ``[T_r, T_r + t_r)`` of each tensor of ``tensors`` concatenated over the ranks in rank
    order, where each rank holds ``source_sizes[rank]`` rows (the same in each of its tensors):
    one all-gather per dtype, padded to the largest; each tensor's rows are flattened and laid
    side by side, so that many small inputs (``input_ids``, ``attention_mask``, ``labels``) cost
    one collective, not one each."""
    world = len(source_sizes)
    longest = max(source_sizes)
    start = sum(target_sizes[:rank])
    out = [None] * len(tensors)
    groups = {}
    for index, tensor in enumerate(tensors):
        dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype  # gloo moves no bool tensors
        groups.setdefault(dtype, []).append(index)
    for dtype, indices in groups.items():
        rows = int(tensors[indices[0]].shape[0])
        widths = [math.prod(tensors[i].shape[1:]) for i in indices]
        send = torch.cat([tensors[i].to(dtype).reshape(rows, -1) for i in indices], dim=1)
        if rows < longest:
            send = torch.cat([send, send.new_zeros((longest - rows, send.shape[1]))])
        send = send.contiguous()
        gathered = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(gathered, send)
        full = torch.cat([gathered[r][:source_sizes[r]] for r in range(world)])[start:start + target_sizes[rank]]
        offset = 0
        for i, width in zip(indices, widths):
            piece = full[:, offset:offset + width].reshape((target_sizes[rank], ) + tuple(tensors[i].shape[1:]))
            out[i] = piece.to(torch.bool) if tensors[i].dtype == torch.bool else piece
            offset += width
    return out


class _ReturnRows(torch.autograd.Function):
    """Computed rows -> the caller's fed rows, for every output that requires a gradient at once;
    the gradients go back to the computing ranks in one all-reduce per dtype.

    A loss over the returned rows is a loss over what this rank was fed, but the engine weighs
    every loss by the rows the rank computed (``W * p_r / N``): the backward rescales the returned
    rows' gradient by ``scale`` (``f_r / p_r``), so such a loss counts as ``W * f_r / N``, whatever
    arithmetic follows and whether it is mixed with a loss computed inside the forward. One
    function for all outputs: its backward runs once, whichever outputs a rank's loss uses (an
    unused one contributes zeros), so ranks may use different outputs."""

    @staticmethod
    def forward(ctx, split, scale, clock, *tensors):
        ctx.split, ctx.scale, ctx.clock = split, scale, clock
        return tuple(_rows_of_many(list(tensors), split.planned, split.fed, split.rank))

    @staticmethod
    def backward(ctx, *grads):
        began = ExchangeClock.mark()
        split, total = ctx.split, sum(ctx.split.fed)
        start, begin = sum(split.fed[:split.rank]), sum(split.planned[:split.rank])
        fulls = []
        for grad in grads:
            full = grad.new_zeros((total, ) + tuple(grad.shape[1:]))
            full[start:start + split.fed[split.rank]] = grad * ctx.scale if ctx.scale != 1.0 else grad
            fulls.append(full)
        # Zeros except each rank's fed rows: the sum is exact. One flat buffer per dtype, in the
        # outputs' order (the same on every rank: their structure was agreed in the forward).
        for dtype in dict.fromkeys(full.dtype for full in fulls):
            group = [full for full in fulls if full.dtype == dtype]
            flat = torch.cat([full.reshape(-1) for full in group])
            dist.all_reduce(flat)
            offset = 0
            for full in group:
                full.copy_(flat[offset:offset + full.numel()].view_as(full))
                offset += full.numel()
        grads = tuple(full[begin:begin + split.planned[split.rank]].clone() for full in fulls)
        if ctx.clock is not None:
            ctx.clock.timed(began)
        return (None, None, None) + grads


def _check_size(fed, planned):
    """Raise on every rank unless the fed micro-batches make up the plan's global micro-batch."""
    if sum(fed) != sum(planned):
        raise ResplitError(
            f"deepspeed-hetero: the ranks were fed micro-batches of {fed} samples ({sum(fed)} in all), but the plan "
            f"in force runs {list(planned)} ({sum(planned)}: train_batch_size / gradient_accumulation_steps). The "
            f"engine re-splits what it is fed, but not a global micro-batch of another size: feed "
            f"train_batch_size / gradient_accumulation_steps / world_size samples per rank and drop a short last "
            f"batch (drop_last=True)")


def _structure_error(planned, dp_rank, what):
    return ResplitError(
        f"deepspeed-hetero: the ranks' {what} differ in structure, dtype or trailing shape (tensors whose dim 0 "
        f"is the batch), so their samples cannot be moved between ranks to follow the plan {list(planned)}. "
        f"Sequences of different lengths are padded only where the batch is a mapping with an attention_mask "
        f"of shape [batch, length] (labels padded with -100); otherwise pad every rank's batch to the same "
        f"length, or feed each rank its planned share with engine.heterogeneous_sampler(dataset) "
        f"(data-parallel rank {dp_rank})")


def resplit_inputs(inputs, kwargs, planned, dp_rank, pad_token_id=None, clock=None):
    """``(inputs, kwargs, split)``: this rank's planned share of what every rank was fed; ``split``
    is None when the ranks were fed the plan (nothing moved) or nothing is batch-first.
    ``pad_token_id`` pads ``input_ids`` where sequence lengths differ (see ``sequence_tensors``);
    ``clock`` (an ``ExchangeClock``) counts the time spent moving."""
    rows = None
    for value in (inputs, kwargs):
        rows = _leading(value)
        if rows is not None:
            break
    rows = 0 if rows is None else rows
    paths, _ = batch_first((inputs, kwargs), rows)
    paddable, length = sequence_tensors((inputs, kwargs), rows, pad_token_id)
    # Two numbers per rank (every rank's fed size and structure in one small all-gather): the
    # structure's checksum with sequence lengths left out, and the length above it. Equal
    # everywhere, the ranks' structures are equal (the lengths too); otherwise they may be padded
    # when only the lengths differ.
    loose = _loose_checksum((inputs, kwargs), rows, paddable)
    gathered = agree(rows, loose | (min(length, 2**30) << 32))
    fed = [row[0] for row in gathered]
    if clock is not None:
        clock.fed = tuple(fed) if any(fed) else None
    if not any(fed):
        return inputs, kwargs, None  # no rank was fed a batch-first tensor: nothing to split
    _check_size(fed, planned)
    split = Split(tuple(fed), tuple(planned), dp_rank)
    if not split.needed or not paths:
        return inputs, kwargs, None  # every rank computes what it was fed, whatever its shapes
    padded_length = 0
    if len({row[1] for row in gathered}) > 1:
        lengths = [row[1] >> 32 for row in gathered]
        if len({row[1] & 0xFFFFFFFF for row in gathered}) > 1 or not all(lengths):
            raise _structure_error(planned, dp_rank, "fed batches")
        padded_length = max(lengths)
        split = Split(tuple(fed), tuple(planned), dp_rank, length, padded_length)
    wanted = set(paths)
    sending = []

    def collect(path, tensor):
        if path in wanted:
            if padded_length and path in paddable:
                tensor = _pad(tensor, padded_length, paddable[path])
            sending.append(tensor.detach())
        return tensor

    began = ExchangeClock.mark()
    _walk((inputs, kwargs), "", collect)
    received = iter(_rows_of_many(sending, split.fed, split.planned, dp_rank))
    inputs, kwargs = _walk((inputs, kwargs), "", lambda path, tensor: next(received) if path in wanted else tensor)
    if clock is not None:
        clock.timed(began)
        clock.micro_steps += 1
    return inputs, kwargs, split


def return_outputs(outputs, split, scale=1.0, clock=None):
    """``outputs`` with every batch-first tensor exchanged back to the rank fed its samples (one
    gather of the structure first, so that every rank exchanges the same tensors); ``scale``
    multiplies the returned rows' gradient on its way back (see ``_ReturnRows``). Where the inputs
    were padded, outputs of the padded length are cut back to this rank's fed length."""
    paths, checksum = batch_first(outputs, split.planned[split.rank])
    gathered = agree(len(paths), checksum)
    if len({row for row in gathered}) > 1:
        raise ResplitError(
            "deepspeed-hetero: the model's outputs differ in structure, dtype or trailing shape between ranks, so "
            "they cannot return to the ranks that were fed their samples; set heterogeneous_config.return_outputs "
            "to false when the loss is computed inside the model")
    wanted = set(paths)
    cut = split.padded_length and split.length < split.padded_length
    differentiable = []

    def collect(path, tensor):
        if path in wanted and tensor.requires_grad:
            differentiable.append(tensor)
        return tensor

    _walk(outputs, "", collect)
    began = ExchangeClock.mark()
    returned = iter(_ReturnRows.apply(split, scale, clock, *differentiable) if differentiable else ())
    plain = [tensor for path, tensor in _tensors(outputs) if path in wanted and not tensor.requires_grad]
    plain = iter(_rows_of_many(plain, split.planned, split.fed, split.rank) if plain else ())

    def back(path, tensor):
        if path not in wanted:
            return tensor
        tensor = next(returned) if tensor.requires_grad else next(plain)
        if cut and tensor.dim() >= 2 and int(tensor.shape[1]) == split.padded_length:
            tensor = tensor[:, :split.length]
        return tensor

    outputs = _walk(outputs, "", back)
    if clock is not None:
        clock.timed(began)
    return outputs
