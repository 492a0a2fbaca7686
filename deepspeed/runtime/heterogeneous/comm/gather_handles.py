# SPDX-License-Identifier: Apache-2.0
"""What the fork's ZeRO-3 gathers hand back to upstream's parameter coordinator: a handle that
completes a gather of parameters cut into slices of any sizes (``uneven_shards.py``: the ranks'
memory-proportional slices; ``host_shards.py``: the host shards), and how such a gather moves its
slices. No collectives are started here.
"""

import torch

from ..memory.zero3_shards import valid_numel


def choose_mode(contributions, world_size):
    """``pad`` or ``owners`` for contributions of these sizes (elements per rank)."""
    return "pad" if (world_size - 1) * max(contributions) <= sum(contributions) else "owners"


class UnevenGatherHandle:
    """Completes an uneven all-gather: waits for its collectives, then gives every parameter its
    full data and marks it available (upstream's ``AllGatherCoalescedHandle`` contract)."""

    def __init__(self, params, spans, pieces, works, available_status):
        self.params, self.spans, self.pieces, self.works = params, spans, pieces, works
        self.available_status = available_status
        self.complete = False

    def wait(self, handle_dependency=True) -> None:
        if self.complete:
            return
        for work in self.works:
            if work is not None:
                work.wait()
        offsets = [0] * len(self.pieces)
        for param, spans in zip(self.params, self.spans):
            parts = []
            for rank, (start, size) in enumerate(spans):
                keep = valid_numel(param, start, size)
                if keep:
                    parts.append(self.pieces[rank].narrow(0, offsets[rank], keep))
                offsets[rank] += size
            param.data = torch.cat(parts).view(param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = self.available_status
        self.complete = True


class MultipleHandles:

    def __init__(self, handles):
        self.handles = handles

    def wait(self, handle_dependency=True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
