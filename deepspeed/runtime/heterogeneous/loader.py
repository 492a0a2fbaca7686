# SPDX-License-Identifier: Apache-2.0
"""The training loader of heterogeneous mode: one micro-batch of this rank's size per ``next()``."""

from torch.utils.data import DataLoader


class HeterogeneousDataLoader:
    """Iterates micro-batches drawn by a ``HeterogeneousBatchSampler``.

    Behaves like upstream's DeepSpeedDataLoader (``iter()``/``next()``, ``len()``, the throughput
    timer) but loads in the main process: the batch sampler then reads the plan in force when each
    micro-batch is drawn, so a plan adopted at a step boundary applies to the very next step.
    """

    def __init__(self, dataset, batch_sampler, collate_fn=None, tput_timer=None):
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.tput_timer = tput_timer
        self.post_process_func = None
        self._loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=0)
        self._iterator = None

    def __iter__(self):
        self._iterator = iter(self._loader)
        return self

    def __len__(self):
        return len(self.batch_sampler)

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self._loader)
        if self.tput_timer:
            self.tput_timer.start()
        batch = next(self._iterator)
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.batch_sampler)
        return batch
