# SPDX-License-Identifier: Apache-2.0
"""Uncaught errors under the deepspeed launcher, for tests/unit/heterogeneous/test_failure_report.py:
each case ends the job the way a real failure does, after the fork's exception hook is installed
(as parsing a config with the fork on installs it).

- ``some``: global rank 1 raises one of the fork's errors while rank 0 waits for it in one of the
  fork's agreements, which breaks;
- ``every``: every rank raises the same fork error (a placement that fits nowhere);
- ``generic``: every rank fails the same assertion, not the fork's.

    deepspeed --num_gpus 2 tests/unit/scripts/failure_report.py --case some
"""

import argparse

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.heterogeneous.cluster.agreement import Agreement
from deepspeed.runtime.heterogeneous.config.errors import one_line_config_errors
from deepspeed.runtime.heterogeneous.memory.rank_placement import MemoryPlacementError


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["some", "every", "generic"], required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    one_line_config_errors()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if args.case == "some":
        if rank == 1:
            raise MemoryPlacementError("data-parallel rank 1 needs 2 GiB on its device, more than its budget 1 GiB")
        Agreement(f"data-parallel rank {rank}").gather_from_every_rank(rank, "the ranks' facts")
    elif args.case == "every":
        dist.barrier()
        raise MemoryPlacementError("no placement fits: data-parallel rank 1 needs 2 GiB, more than its budget 1 GiB")
    else:
        dist.barrier()
        assert 32 == 8 * 3 * 2, "Check batch related parameters. train_batch_size is not equal to 8 * 3 * 2"


if __name__ == "__main__":
    main()
