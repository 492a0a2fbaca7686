# SPDX-License-Identifier: Apache-2.0
"""The training loader of heterogeneous mode: one micro-batch of this rank's size per ``next()``."""

from torch.utils.data import DataLoader


class HeterogeneousDataLoader:
    """Iterates micro-batches drawn by a ``HeterogeneousBatchSampler``.

    Behaves like upstream's DeepSpeedDataLoader (``iter()``/``next()``, ``len()``, the throughput
    timer, ``num_workers``, ``pin_memory``, ``collate_fn``). The batch sampler reads the plan in
    force when a round is drawn, so a plan adopted at a step boundary must find no round of the next
    step drawn yet:

    - without workers the main process draws each micro-batch when it is asked for;
    - with workers, a DataLoader would draw ``prefetch_factor * num_workers`` micro-batches ahead,
      across step boundaries. Here the workers (persistent) load one optimizer step's micro-batches
      at a time, in parallel, and the next step's are drawn only when its first one is asked for.
    """

    def __init__(self, dataset, batch_sampler, collate_fn=None, tput_timer=None, num_workers=0, pin_memory=False,
                 micro_batches_per_step=None):
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.tput_timer = tput_timer
        self.post_process_func = None
        self.num_workers = int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_local_io_workers = {num_workers} must be >= 0")
        if self.num_workers == 0:
            self._loader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=0,
                                      pin_memory=pin_memory)
        else:
            if micro_batches_per_step is None:
                raise ValueError("micro_batches_per_step is required with num_workers > 0")
            self._window = _StepWindow(micro_batches_per_step)
            self._loader = DataLoader(dataset, batch_sampler=self._window, collate_fn=collate_fn,
                                      num_workers=self.num_workers, pin_memory=pin_memory, persistent_workers=True)
        self._iterator = None

    def __iter__(self):
        self._iterator = iter(self._loader) if self.num_workers == 0 else self._start_pass()
        return self

    def __len__(self):
        return len(self.batch_sampler)

    def __next__(self):
        if self._iterator is None:
            self.__iter__()
        if self.tput_timer:
            self.tput_timer.start()
        batch = next(self._iterator)
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.batch_sampler)
        return batch

    def _start_pass(self):
        self._window.source = iter(self.batch_sampler)
        return self._by_steps()

    def _by_steps(self):
        """One pass: each step's micro-batches through the workers, drawn when the step starts."""
        while True:
            self._window.refill()
            if not self._window.pending:
                return
            yield from iter(self._loader)


class _StepWindow:
    """The batch sampler the worker DataLoader sees: the micro-batches of one optimizer step."""

    def __init__(self, micro_batches_per_step):
        self.micro_batches_per_step = micro_batches_per_step
        self.source = None
        self.pending = []

    def refill(self):
        self.pending = []
        for _ in range(int(self.micro_batches_per_step())):
            try:
                self.pending.append(next(self.source))
            except StopIteration:
                break

    def __iter__(self):
        # A generator: a DataLoader creates sampler iterators it never advances, which must not
        # take the step's micro-batches.
        while self.pending:
            yield self.pending.pop(0)

    def __len__(self):
        return len(self.pending)
