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
  global micro-batch's rows, zeros except the rows a rank was fed: exact), rescaled by fed /
  computed rows so that a loss over the returned rows counts by what the rank was fed. Scalar
  outputs (a loss computed inside the forward) stay the rank's own: a loss over the samples it
  computed, weighted by those. Every rank's loss must use the same returned outputs (each one's
  backward is a collective).

Every rank runs the same collectives: one gather of two numbers per micro-step (the fed size and
a checksum of the batch-first tensors: their number, structure, dtypes and trailing shapes),
then, only where the fed sizes differ from the plan, one all-gather per batch-first input and per
output. Structures that differ between ranks (different trailing shapes, as with dynamic
padding) stop every rank with one message, as does a global micro-batch of another size than
the plan's.
"""

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deepspeed import comm as dist


class ResplitError(ValueError):
    """The ranks' fed micro-batches cannot be re-split into the plan (every rank raises it)."""


@dataclass(frozen=True)
class Split:
    """One micro-step's re-split: what each data-parallel rank was fed and computes."""

    fed: tuple
    planned: tuple
    rank: int

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


def _walk(value, path, visit):
    """Rebuild ``value`` with ``visit(path, tensor)`` applied to every tensor (depth first)."""
    if isinstance(value, torch.Tensor):
        return visit(path, value)
    if isinstance(value, Mapping):
        items = {key: _walk(item, f"{path}.{key}", visit) for key, item in value.items()}
        if hasattr(value, "to_tuple"):  # transformers' ModelOutput: a dataclass of its fields
            return type(value)(**items)
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, (list, tuple)):
        items = [_walk(item, f"{path}[{index}]", visit) for index, item in enumerate(value)]
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    return value


def batch_first(value, rows):
    """``(paths of the batch-first tensors, checksum of the structure)``: the tensors whose dim 0
    is ``rows``; their number, paths, dtypes and trailing shapes make the checksum ranks compare."""
    paths, tokens = [], []

    def visit(path, tensor):
        if tensor.dim() > 0 and int(tensor.shape[0]) == rows:
            paths.append(path)
            tokens.append(f"{path}:{tensor.dtype}:{tuple(tensor.shape[1:])}")
        return tensor

    _walk(value, "", visit)
    return paths, zlib.crc32(f"{len(paths)}|{'|'.join(tokens)}".encode())


def agree(fed, checksum, what):
    """Every rank's (fed rows, checksum of its batch-first tensors), gathered: one collective of two
    numbers per rank."""
    from deepspeed.accelerator import get_accelerator
    device = "cpu" if _gloo() else get_accelerator().current_device_name()
    mine = torch.tensor([int(fed), int(checksum)], dtype=torch.long, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [tuple(int(v) for v in row.tolist()) for row in everyone]


def _gloo():
    import torch.distributed
    return torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"


def _rows(tensor, source_sizes, target_sizes, rank):
    """Rows ``[T_r, T_r + t_r)`` of the ranks' tensors concatenated in rank order, where each rank
    holds ``source_sizes[rank]`` rows: one all-gather, padded to the largest."""
    world = len(source_sizes)
    longest = max(source_sizes)
    send = tensor
    if send.dtype == torch.bool:  # gloo reduces no bool tensors
        send = send.to(torch.uint8)
    if send.shape[0] < longest:
        pad = send.new_zeros((longest - send.shape[0], ) + tuple(send.shape[1:]))
        send = torch.cat([send, pad])
    send = send.contiguous()
    gathered = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(gathered, send)
    full = torch.cat([gathered[r][:source_sizes[r]] for r in range(world)])
    start = sum(target_sizes[:rank])
    out = full[start:start + target_sizes[rank]]
    return out.to(torch.bool) if tensor.dtype == torch.bool else out


class _ReturnRows(torch.autograd.Function):
    """Computed rows -> the caller's fed rows; the gradient goes back to the computing rank.

    A loss over the returned rows is a loss over what this rank was fed, but the engine weighs
    every loss by the rows the rank computed (``W * p_r / N``): the backward rescales the returned
    rows' gradient by ``scale`` (``f_r / p_r``), so such a loss counts as ``W * f_r / N``, whatever
    arithmetic follows and whether it is mixed with a loss computed inside the forward."""

    @staticmethod
    def forward(ctx, tensor, split, scale):
        ctx.split, ctx.scale = split, scale
        return _rows(tensor, split.planned, split.fed, split.rank)

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        full = grad.new_zeros((sum(split.fed), ) + tuple(grad.shape[1:]))
        start = sum(split.fed[:split.rank])
        full[start:start + split.fed[split.rank]] = grad * ctx.scale if ctx.scale != 1.0 else grad
        dist.all_reduce(full)  # zeros except each rank's fed rows: the sum is exact
        begin = sum(split.planned[:split.rank])
        return full[begin:begin + split.planned[split.rank]].clone(), None, None


def _check(rows, dp_rank, planned, what):
    """Raise on every rank unless the gathered rows of the ranks can be re-split."""
    fed = [row[0] for row in rows]
    if sum(fed) != sum(planned):
        raise ResplitError(
            f"deepspeed-hetero: the ranks were fed micro-batches of {fed} samples ({sum(fed)} in all), but the plan "
            f"in force runs {list(planned)} ({sum(planned)}: train_batch_size / gradient_accumulation_steps). The "
            f"engine re-splits what it is fed, but not a global micro-batch of another size: feed "
            f"train_batch_size / gradient_accumulation_steps / world_size samples per rank and drop a short last "
            f"batch (drop_last=True)")
    if len({row[1:] for row in rows}) > 1:
        raise ResplitError(
            f"deepspeed-hetero: the ranks' {what} differ in structure, dtype or trailing shape (tensors whose dim 0 "
            f"is the batch), so their samples cannot be moved between ranks to follow the plan "
            f"{list(planned)}; pad every rank's batch to the same shape (with dynamic padding: pad to a fixed "
            f"length; the attention mask keeps the result), or feed each rank its planned share with "
            f"engine.heterogeneous_sampler(dataset) (data-parallel rank {dp_rank})")
    return fed


def resplit_inputs(inputs, kwargs, planned, dp_rank):
    """``(inputs, kwargs, split)``: this rank's planned share of what every rank was fed; ``split``
    is None when the ranks were fed the plan (nothing moved) or nothing is batch-first."""
    rows = None
    for value in (inputs, kwargs):
        rows = _leading(value)
        if rows is not None:
            break
    rows = 0 if rows is None else rows
    paths, checksum = batch_first((inputs, kwargs), rows)
    gathered = agree(rows, checksum, "the fed batch")
    if not any(row[0] for row in gathered):
        return inputs, kwargs, None  # no rank was fed a batch-first tensor: nothing to split
    fed = _check(gathered, dp_rank, planned, "fed batches")
    split = Split(tuple(fed), tuple(planned), dp_rank)
    if not split.needed or not paths:
        return inputs, kwargs, None
    wanted = set(paths)

    def move(path, tensor):
        return _rows(tensor.detach(), split.fed, split.planned, dp_rank) if path in wanted else tensor

    inputs, kwargs = _walk((inputs, kwargs), "", move)
    return inputs, kwargs, split


def return_outputs(outputs, split, scale=1.0):
    """``outputs`` with every batch-first tensor exchanged back to the rank fed its samples (one
    gather of the structure first, so that every rank exchanges the same tensors); ``scale``
    multiplies the returned rows' gradient on its way back (see ``_ReturnRows``)."""
    paths, checksum = batch_first(outputs, split.planned[split.rank])
    gathered = agree(len(paths), checksum, "the outputs")
    if len({row for row in gathered}) > 1:
        raise ResplitError(
            "deepspeed-hetero: the model's outputs differ in structure, dtype or trailing shape between ranks, so "
            "they cannot return to the ranks that were fed their samples; set heterogeneous_config.return_outputs "
            "to false when the loss is computed inside the model")
    wanted = set(paths)

    def back(path, tensor):
        if path not in wanted:
            return tensor
        if tensor.requires_grad:
            return _ReturnRows.apply(tensor, split, scale)
        return _rows(tensor, split.planned, split.fed, split.rank)

    return _walk(outputs, "", back)


def _leading(value):
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            size = _leading(item)
            if size is not None:
                return size
    return None
