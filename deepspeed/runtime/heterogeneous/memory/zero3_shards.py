# SPDX-License-Identifier: Apache-2.0
"""Memory-proportional ZeRO-3 shards (``heterogeneous_memory.zero_partitions`` in stage 3).

Upstream ZeRO-3 gives rank r the slice ``[r*c, (r+1)*c)`` of every partitioned parameter, with
``c = ceil(numel / world)``: the same size everywhere, so the device with the least memory bounds
the model. Here rank r owns the slice ``spans[r] = (start_r, size_r)``, its share ``f_r`` of the
elements, and so ``f_r`` of the parameter's fp32 master copy, gradient and optimizer state.

- ``ShardLayout.spans``: where each rank's slice of one parameter lies. Boundaries sit on
  multiples of ``ALIGNMENT`` elements, every slice is non-empty, the slices cover the parameter
  exactly (no padding). A parameter too small to cut that way keeps upstream's equal slices
  (``None``); a bucket may mix both.
- The collectives of uneven slices (gathers, the gradients' reduce-scatter) are in
  ``comm/uneven_shards.py``.
- ``partition_shares_for_init``: the shares a ``deepspeed.zero.Init`` partitions with, known
  before the model exists (the engine's own decision while it builds its ZeRO-3 optimizer, else
  the config's list).

Every rank computes the same spans from the same shares and numel; ``agree_on_shards`` compares a
digest once, before the first collective that depends on them, so a disagreement is an error
naming the ranks rather than a hang.
"""

import contextlib
import hashlib
import math
from typing import Optional, Sequence, Tuple

import torch

REFRESH_CHUNK_BYTES = 1 << 20
"""Host shards (``comm/host_shards.py``): bytes of stale parameters per refresh all-to-all (a chunk
closes after the parameter that reaches it): small enough that a bucket's first layers need not
wait for its last, large enough that the all-to-alls' start-up stays small against their transfer.
Here, beside the shards, so that the peak model (``peak.py``) reads the same defaults."""

CHUNKS_IN_FLIGHT = 4
"""Host shards: refresh chunks whose all-to-alls run at once; the next starts when the oldest
completes, so the refresh's buffers stay a few chunks while the forward computes."""

ALIGNMENT = 32  # elements; slices start on 128-byte boundaries in fp32
CHECKPOINT_SHARES_KEY = "heterogeneous_zero3_shares"
CHECKPOINT_NUMELS_KEY = "heterogeneous_zero3_shard_numels"


class ShardLayoutError(ValueError):
    """Shares that cannot be used for ZeRO-3 shards, or a checkpoint of another layout."""


class ShardLayout:
    """The shares of every partitioned ZeRO-3 parameter, and each parameter's slices."""

    def __init__(self, shares: Sequence[float], alignment: int = ALIGNMENT):
        self.shares = tuple(float(s) for s in shares)
        self.world_size = len(self.shares)
        self.alignment = int(alignment)
        self._cuts = [sum(self.shares[:r]) for r in range(1, self.world_size)]

    def spans(self, numel: int) -> Optional[Tuple[Tuple[int, int], ...]]:
        """``((start, size), ...)`` per rank for a parameter of ``numel`` elements, or None where
        the parameter keeps upstream's equal slices (too small for every rank to get at least one
        aligned unit)."""
        world, unit = self.world_size, self.alignment
        units = numel // unit
        if units < world:
            return None
        bounds = [0]
        for rank, cut in enumerate(self._cuts, start=1):
            # At least one unit per rank on either side of each boundary.
            bound = min(max(int(round(cut * units)), bounds[-1] + 1), units - (world - rank))
            bounds.append(bound)
        starts = [b * unit for b in bounds] + [numel]
        return tuple((starts[r], starts[r + 1] - starts[r]) for r in range(world))

    def describe(self):
        from .partitions import describe_shares
        return describe_shares(self.shares)


def shard_layout(shares, world_size):
    """The ``ShardLayout`` for ``shares`` (None, or equal shares: upstream's slices, no layout)."""
    if shares is None or int(world_size) < 2:
        return None
    shares = tuple(float(s) for s in shares)
    if len(shares) != int(world_size):
        raise ShardLayoutError(f"heterogeneous_memory.zero_partitions has {len(shares)} shares {list(shares)} but the "
                               f"ZeRO-3 partition group has {world_size} ranks; give one share per rank")
    if max(shares) - min(shares) < 1e-9:
        return None
    return ShardLayout(shares)


# -- one rank's slice of a parameter, either layout ---------------------------------------------------


def param_spans(param, world_size):
    """Every rank's ``(start, size)`` slice of ``param``: its uneven spans, or upstream's equal
    slices (``size`` is then the padded partition size, the last ones reaching past ``ds_numel``)."""
    spans = getattr(param, "ds_shard_spans", None)
    if spans is not None:
        return spans
    size = math.ceil(param.ds_numel / world_size)
    return tuple((rank * size, size) for rank in range(world_size))


def valid_numel(param, start, size):
    """How many of the slice's elements lie inside the parameter (the rest is upstream's padding)."""
    return max(0, min(size, param.ds_numel - start))


def holds_data(param, rank, world):
    """Whether this rank's slice of ``param`` holds any of its elements (upstream's last equal
    slices may be padding only)."""
    start, size = param_spans(param, world)[rank]
    return valid_numel(param, start, size) > 0


def is_uneven(params):
    return any(getattr(p, "ds_shard_spans", None) is not None for p in params)


def layout_of(params):
    """The ``ShardLayout`` the parameters were partitioned with (None: upstream's slices)."""
    for p in params:
        layout = getattr(p, "ds_shard_layout", None)
        if layout is not None:
            return layout
    return None


def local_slice(param, full, rank, world):
    """This rank's slice of ``full`` (a tensor of the parameter's shape), zero-padded to its
    partition size where upstream's equal slices reach past the parameter."""
    start, size = param_spans(param, world)[rank]
    flat = full.reshape(-1)
    keep = valid_numel(param, start, size)
    if keep == size:
        return flat.narrow(0, start, size)
    out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    if keep:
        out.narrow(0, 0, keep).copy_(flat.narrow(0, start, keep))
    return out


# -- the shares, before the model exists -----------------------------------------------------------

_engine_shares = []  # the shares of the ZeRO-3 optimizer being built, innermost last


@contextlib.contextmanager
def engine_partitioning(shares):
    """While the engine builds its ZeRO-3 optimizer, the ``zero.Init`` that partitions the model's
    parameters uses the engine's shares (None: upstream's equal slices)."""
    _engine_shares.append(None if shares is None else tuple(shares))
    try:
        yield
    finally:
        _engine_shares.pop()


def partition_shares_for_init(ds_config, world_size):
    """The shares a ``zero.Init`` partitions with: the engine's, while it builds its optimizer;
    else, with ``heterogeneous_config.enabled`` and ZeRO stage 3 in ``ds_config`` (a coordinated
    ``DeepSpeedConfig``), an explicit ``zero_partitions`` list, or for ``"auto"`` (with
    ``heterogeneous_memory.enabled``) the prior from the gathered devices (``pool.init_prior_shares``,
    settled by the coordinator as ``state.init_shares``);
    else None (equal slices)."""
    if _engine_shares:
        return _engine_shares[-1]
    state = getattr(ds_config, "heterogeneous", None) if ds_config is not None else None
    settings = getattr(state, "settings", None)
    if settings is None or not settings.config.enabled:
        return None
    if int(getattr(ds_config, "zero_optimization_stage", 0) or 0) != 3:
        return None
    shares = settings.memory.zero_partitions
    if isinstance(shares, (list, tuple)):
        from .partitions import check_shares
        return check_shares(shares, int(world_size))
    if shares == "auto" and settings.memory.enabled and int(world_size) > 1:
        # The coordinator's prior from the gathered devices (coordinator._settle_config), when the
        # config was coordinated over this world.
        prior = getattr(state, "init_shares", None)
        if prior is not None and len(prior) == int(world_size):
            if state.dp_rank == 0:
                from deepspeed.utils import logger
                from .partitions import describe_shares
                logger.warning(f"deepspeed-hetero: zero.Init cuts the ZeRO-3 parameters by the ranks' memory, "
                               f"{describe_shares(prior)} (heterogeneous_memory.zero_partitions \"auto\", before the "
                               "model is known); the engine re-partitions once if the model calls for other shares")
            return tuple(prior)
    return None


def existing_shares(model):
    """How ``model``'s parameters are already cut, where ``zero.Init`` partitioned them before the
    engine started: their shares, ``"even"``, or None (not partitioned yet: the engine decides)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")] if model is not None else []
    if not params:
        return None
    layout = layout_of(params)
    return "even" if layout is None else list(layout.shares)


def refuse_unsupported(layout, hpz_group=None, quantized=False):
    """Uneven shards with what keeps upstream's equal slices elsewhere are refused by name."""
    if layout is None:
        return
    unsupported = [name for name, used in (("zero_hpz_partition_size > 1", hpz_group is not None),
                                           ("zero_quantized_weights / zero_quantized_nontrainable_weights",
                                            quantized)) if used]
    if unsupported:
        raise ShardLayoutError(f"heterogeneous_memory.zero_partitions {layout.describe()} gives ZeRO-3 ranks uneven "
                               f"shards, which {' and '.join(unsupported)} cannot use (they cut equal slices); "
                               "set zero_partitions to \"even\" or turn them off")


def init_param(param, layout, world_size):
    """Give a newly converted ZeRO-3 parameter its slices (``_convert_to_deepspeed_param``)."""
    if layout is not None and layout.world_size != int(world_size):
        layout = None  # a parameter partitioned over another group (experts) keeps equal slices
    param.ds_shard_layout = layout
    param.ds_shard_spans = None if layout is None else layout.spans(param.ds_numel)


# -- agreement and checkpoints ---------------------------------------------------------------------


def shards_digest(params, shares):
    text = repr((None if shares is None else [round(s, 9) for s in shares],
                 [getattr(p, "ds_shard_spans", None) for p in params]))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def agree_on_shards(params, shares, group=None):
    """All ranks compare the digest of their parameters' slices (one all-gather of an int64)."""
    from .partitions import ranks_differing_from_rank_0
    differing = ranks_differing_from_rank_0(shards_digest(params, shares), group)
    if differing:
        raise ShardLayoutError(f"the ranks partition the ZeRO-3 parameters differently (data-parallel ranks "
                               f"{differing} differ from rank 0): every rank must use the same "
                               "heterogeneous_memory.zero_partitions and build the same model")


def optimizer_shares(param_groups, group, use_muon=False):
    """The shares the ZeRO-3 optimizer's parameters were partitioned with (None: equal slices),
    checked to be the same on every rank."""
    params = [p for param_group in param_groups for p in param_group["params"]]
    layout = layout_of(params)
    if layout is None:
        return None
    if use_muon:
        raise ShardLayoutError(f"heterogeneous_memory.zero_partitions {layout.describe()}: uneven ZeRO-3 shards cannot "
                               "be used with the Muon optimizer (it updates equal slices); set zero_partitions to \"even\"")
    agree_on_shards(params, layout.shares, group)
    return layout.shares


def checkpoint_entries(params, shares):
    """What a ZeRO-3 optimizer state dict records of an uneven layout (nothing for upstream's)."""
    if shares is None:
        return {}
    return {CHECKPOINT_SHARES_KEY: list(shares),
            CHECKPOINT_NUMELS_KEY: [int(p.partition_numel()) for p in params]}


def universal_fragments(optim_sd, param_shapes, partition_rank, partition_count):
    """``ds_to_universal``'s extraction of one rank's ZeRO-3 optimizer file saved with uneven shares
    (None for upstream's equal slices): ``(name, state_key, flat_state, offset, numel)`` for every
    fragment, over the rank's sub-groups taken together (their boundaries follow the rank's own
    slice sizes, so they may differ between ranks)."""
    shares = optim_sd.get(CHECKPOINT_SHARES_KEY)
    if shares is None:
        return None
    layout = ShardLayout(shares)
    groups = range(len(optim_sd["fp32_flat_groups"]))
    state = optim_sd["optimizer_state_dict"]["state"]
    flat = {key: torch.cat([state[i][key].view(-1) for i in groups]) for key in ("exp_avg", "exp_avg_sq")}
    flat["fp32"] = torch.cat([optim_sd["fp32_flat_groups"][i].view(-1) for i in groups])
    fragments, offset = [], 0
    for name, shape in ((n, s) for sub_group in param_shapes for n, s in sub_group.items()):
        numel = math.prod(shape) if not isinstance(shape, int) else shape
        spans = layout.spans(numel)
        start, size = spans[partition_rank] if spans is not None else (partition_rank * math.ceil(numel / partition_count),
                                                                       math.ceil(numel / partition_count))
        keep = max(0, min(size, numel - start))
        fragments.extend((name, key, tensor, offset, keep) for key, tensor in flat.items())
        offset += size
    return fragments


def check_checkpoint_shares(state_dict, shares):
    """Refuse a per-rank ZeRO-3 checkpoint saved with other shares: its slices would not fit."""
    saved = state_dict.get(CHECKPOINT_SHARES_KEY)
    saved = None if saved is None else tuple(float(s) for s in saved)
    current = None if shares is None else tuple(shares)
    if saved == current or (saved is not None and current is not None and len(saved) == len(current)
                            and max(abs(a - b) for a, b in zip(saved, current)) < 1e-9):
        return

    def describe(values):
        from .partitions import describe_shares
        return "equal shares" if values is None else describe_shares(values)

    raise ShardLayoutError(
        f"this ZeRO-3 checkpoint was saved with partition shares {describe(saved)} but this run partitions "
        f"with {describe(current)} (heterogeneous_memory.zero_partitions); load it with the shares it was saved "
        "with, or let the load re-partition it (heterogeneous_config.elastic.repartition: true, the default, "
        "converts it to a universal checkpoint, which re-partitions)")
