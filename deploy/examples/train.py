"""Train a small classifier on handwritten digits served by loaderd.

    loaderd serve --config deploy/ds.yaml          # in another terminal
    python deploy/examples/train.py [--epochs 5]

Each epoch prints its training loss and the validation accuracy (359 images):
the loss falls from ~1.5 to ~0.15, and accuracy passes 90% by the second epoch
(93-96% from then on; the validation set is small, so it moves a few points).
"""

from __future__ import annotations

from digits import accuracy, arguments, make_model, make_optimizer, train_epoch

from loaderd import RemoteDataLoader


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    # Batches are fetched, augmented and collated in the daemon's warm pool.
    train = RemoteDataLoader("digits-train", batch_size=32, shuffle=True, address=args.address)
    val = RemoteDataLoader("digits-val", batch_size=256, address=args.address)
    model = make_model()
    optimizer = make_optimizer(model)
    for epoch in range(args.epochs):
        loss = train_epoch(model, optimizer, train)
        print(f"epoch {epoch}: train loss {loss:.3f}, val accuracy {accuracy(model, val):.1%}", flush=True)


if __name__ == "__main__":
    main()
