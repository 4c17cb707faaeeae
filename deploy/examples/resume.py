"""Checkpoint mid-epoch and resume, in another process, exactly where training stopped.

    loaderd serve --config deploy/ds.yaml          # in another terminal
    python deploy/examples/resume.py --checkpoint /tmp/digits.pt --stop-after 50   # saves after 50 steps, exits
    python deploy/examples/resume.py --checkpoint /tmp/digits.pt                   # resumes from it and finishes

The checkpoint holds the model, the optimizer and ``loader.state_dict()``: the
resumed run sees exactly the batches (shuffle order and augmentation) the
uninterrupted run would have, so it ends with the same weights. The last line
prints a checksum of them: compare it with a run without --stop-after.
"""

from __future__ import annotations

import os

import torch
from digits import accuracy, arguments, make_model, make_optimizer, train_step

from loaderd import RemoteDataLoader


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], epochs=2)
    parser.add_argument("--checkpoint", required=True, help="file to resume from (if it exists) and save to")
    parser.add_argument("--stop-after", type=int, default=0, help="save and exit after this many steps in all (0: never)")
    args = parser.parse_args()
    train = RemoteDataLoader("digits-train", batch_size=32, shuffle=True, address=args.address)
    val = RemoteDataLoader("digits-val", batch_size=256, address=args.address)
    model = make_model()
    optimizer = make_optimizer(model)
    step, epoch = 0, 0
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        train.load_state_dict(saved["loader"])  # the next iter(train) continues the interrupted epoch
        step, epoch = saved["step"], saved["epoch"]
        print(f"resumed at epoch {epoch}, step {step}", flush=True)
    while epoch < args.epochs:
        model.train()
        for images, labels in train:
            train_step(model, optimizer, images, labels)
            step += 1
            if step == args.stop_after:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": train.state_dict()}
                torch.save({**state, "step": step, "epoch": epoch}, args.checkpoint)
                print(f"saved {args.checkpoint} at epoch {epoch}, step {step}; run again without --stop-after to resume")
                return
        print(f"epoch {epoch}: val accuracy {accuracy(model, val):.1%}", flush=True)
        epoch += 1
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"done after {step} steps: weights checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
