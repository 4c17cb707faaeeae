"""Distributed data parallel: each rank trains on its own shard, read from one daemon.

    loaderd serve --config deploy/ds.yaml          # in another terminal
    torchrun --nproc-per-node 2 deploy/examples/ddp.py [--epochs 3]

``rank=``/``world_size=`` give each rank a DistributedSampler shard (the same
one torch's DistributedSampler would), served by the daemon's one warm pool:
two ranks, no per-rank worker processes. CPU only (gloo); rank 0 prints.
"""

from __future__ import annotations

import torch.distributed as dist
from digits import accuracy, arguments, make_model, make_optimizer, train_epoch
from torch.nn.parallel import DistributedDataParallel

from loaderd import RemoteDataLoader


def main() -> None:
    args = arguments(__doc__.splitlines()[0], epochs=3).parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        train = RemoteDataLoader(
            "digits-train", batch_size=32, shuffle=True, rank=rank, world_size=world_size, address=args.address
        )
        val = RemoteDataLoader("digits-val", batch_size=256, address=args.address)
        model = DistributedDataParallel(make_model())  # same initial weights on every rank
        optimizer = make_optimizer(model)
        for epoch in range(args.epochs):
            train.set_epoch(epoch)  # a new shuffle each epoch, as with DistributedSampler
            loss = train_epoch(model, optimizer, train)
            if rank == 0:
                print(
                    f"epoch {epoch}: rank 0 of {world_size} trained on {len(train)} batches, "
                    f"train loss {loss:.3f}, val accuracy {accuracy(model, val):.1%}",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
