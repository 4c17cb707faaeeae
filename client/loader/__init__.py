"""The public loader: ``RemoteDataLoader``, its argument checks, its epochs, its plan and its identity.

Owns what a user constructs and what stays the same across epochs: the arguments
(checked against torch's DataLoader's rules), the plan (torch's own samplers over a
stand-in of the daemon's dataset) and the loader's fingerprint and share seed; and
``LoaderEpochs``, the loader's epochs one ``iter(loader)`` after another (the counter,
the epoch planned ahead, a loaded state). May import every other client package,
``loaderd.wire``, ``loaderd.errors`` and ``loaderd.v1``; nothing of ``loaderd.server``.
"""
