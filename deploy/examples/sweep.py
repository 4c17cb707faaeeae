"""A learning-rate sweep: three trainers read one shared stream of batches (``share=``).

    loaderd serve --config deploy/ds.yaml          # in another terminal
    python deploy/examples/sweep.py [--epochs 3] [--lrs 0.01,0.05,0.2]

Starts one trainer process per learning rate. Their loaders name the same
``share``, so the daemon fetches, augments and collates each batch once and
hands it to all three (same batches, same order, same augmentation): the
comparison is fair and the pool does a third of the work.
"""

from __future__ import annotations

import multiprocessing

from digits import accuracy, arguments, make_model, make_optimizer, train_epoch

from loaderd import RemoteDataLoader


def trainer(lr: float, epochs: int, address: str | None) -> tuple[float, float]:
    """Train with ``lr``; the last epoch's (train loss, val accuracy)."""
    train = RemoteDataLoader("digits-train", batch_size=32, shuffle=True, share="digits-sweep", address=address)
    val = RemoteDataLoader("digits-val", batch_size=256, address=address)
    model = make_model()
    optimizer = make_optimizer(model, lr)
    loss = 0.0
    for epoch in range(epochs):
        loss = train_epoch(model, optimizer, train)
        print(f"lr {lr:g}, epoch {epoch}: train loss {loss:.3f}", flush=True)
    return loss, accuracy(model, val)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], epochs=3)
    parser.add_argument("--lrs", default="0.01,0.05,0.2", help="comma-separated learning rates, one trainer each")
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    # spawn: each trainer is a fresh process, as separate training jobs would be.
    with multiprocessing.get_context("spawn").Pool(len(lrs)) as pool:
        results = pool.starmap(trainer, [(lr, args.epochs, args.address) for lr in lrs])
    for lr, (loss, acc) in zip(lrs, results):
        print(f"lr {lr:g}: final train loss {loss:.3f}, val accuracy {acc:.1%}")
    best = max(zip(lrs, results), key=lambda item: item[1][1])
    print(f"best: lr {best[0]:g}")


if __name__ == "__main__":
    main()
