# SPDX-License-Identifier: Apache-2.0
"""A nested batch's tensors, as the re-split (``resplit.py``) sees them, without moving any: the
walk over positional and keyword arguments, mappings, lists and tuples (``_walk``), which tensors
are batch-first and the checksum of their structure the ranks compare (``batch_first``), and the
sequence tensors that may be padded to a common length (``sequence_tensors``). No collective here."""

import zlib
from collections.abc import Mapping

import torch


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


LABEL_FILL = -100  # the label transformers' losses (and torch's cross_entropy default) ignore


def sequence_tensors(value, rows, pad_token_id=None):
    """``({path: fill value}, length)``: the batch-first tensors that may be padded on the right
    along dim 1, and their length. They are those in a mapping with an ``attention_mask`` of shape
    ``[rows, length]`` whose dim 1 is ``length``; ``({}, 0)`` without such a mask (or with two of
    different lengths). Fill values: ``labels`` -100, ``input_ids`` the model's ``pad_token_id``
    (a model may find a sequence's end by it), anything else (the mask included) 0."""
    found, lengths = {}, set()

    def visit(node, path):
        if isinstance(node, Mapping):
            mask = node.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and int(mask.shape[0]) == rows:
                length = int(mask.shape[1])
                lengths.add(length)
                for key, item in node.items():
                    if (isinstance(item, torch.Tensor) and item.dim() >= 2 and int(item.shape[0]) == rows
                            and int(item.shape[1]) == length):
                        fill = LABEL_FILL if "label" in str(key) else 0
                        if key == "input_ids" and pad_token_id is not None:
                            fill = pad_token_id
                        found[f"{path}.{key}"] = fill
            for key, item in node.items():
                visit(item, f"{path}.{key}")
        elif isinstance(node, (list, tuple)):
            for index, item in enumerate(node):
                visit(item, f"{path}[{index}]")

    visit(value, "")
    if len(lengths) != 1:
        return {}, 0
    return found, lengths.pop()


def _loose_checksum(value, rows, paddable):
    """The structure's checksum with the paddable tensors' dim 1 left out."""
    tokens = []

    def visit(path, tensor):
        if tensor.dim() > 0 and int(tensor.shape[0]) == rows:
            shape = tuple(tensor.shape[1:])
            if path in paddable:
                shape = ("length", ) + shape[1:]
            tokens.append(f"{path}:{tensor.dtype}:{shape}")
        return tensor

    _walk(value, "", visit)
    return zlib.crc32(f"{len(tokens)}|{'|'.join(tokens)}".encode())


def _pad(tensor, length, fill):
    """``tensor`` padded on the right along dim 1 to ``length`` with ``fill``."""
    missing = length - int(tensor.shape[1])
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.shape[0], missing) + tuple(tensor.shape[2:]), fill)
    return torch.cat([tensor, pad], dim=1)



def _tensors(value):
    """``[(path, tensor)]`` of every tensor in ``value``, in ``_walk``'s order."""
    found = []

    def visit(path, tensor):
        found.append((path, tensor))
        return tensor

    _walk(value, "", visit)
    return found


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
