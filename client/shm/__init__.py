"""The client's side of the shared-memory fast path: the session, its leases, the copy fence.

Owns the same-host proof (``ShmSession``), the slots a process holds (``Leases``), how
often the session sends the dropped ones (``ReleasePeriod``) and the rule that a pinned slot goes back only after its GPU copies ran (``CopyFence``).
May import ``loaderd.channel`` and the shared layers.
"""
