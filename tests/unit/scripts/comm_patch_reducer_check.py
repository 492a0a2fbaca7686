# SPDX-License-Identifier: Apache-2.0
"""Run from the root of a DeepSpeed tree: 4 gloo ranks playing hosts (0, 0, 1, 1) sum through the
tree's HierarchicalReducer and compare with the flat all-reduce. Prints one JSON line."""
import json
import os
import sys

import torch
import torch.multiprocessing as mp

HOSTS = (0, 0, 1, 1)


def rank_main(rank, port, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(HOSTS)), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.comm.hierarchical import HierarchicalReducer
    deepspeed.init_distributed(dist_backend="gloo")
    reducer = HierarchicalReducer(HOSTS)
    grads = torch.arange(11, dtype=torch.float32) * (rank + 1) + rank  # 11: not a multiple of 2, padded
    flat = grads.clone()
    dist.all_reduce(flat)
    reducer.all_reduce(grads)
    queue.put((rank, deepspeed.__file__, grads.tolist(), flat.tolist()))
    dist.barrier()


if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, port, queue)) for rank in range(len(HOSTS))]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    print(json.dumps({"files": [r[1] for r in results], "hierarchical": [r[2] for r in results],
                      "flat": [r[3] for r in results], "exit": [p.exitcode for p in procs]}))
    sys.exit(0)
