"""One epoch of a loader: its RNG draws, its index batches, its iterator, its resume state.

Owns what ``iter(loader)`` starts: ``EpochStart`` (torch's draws, fresh or replayed),
the plan's index batches, ``RemoteLoaderIter`` with its lanes, its placement per mode
(``modes``: spread, share, iterable) and its plan, the table of positions asked, held,
received and hedged (``Positions``), the outage clock (``OutageClock``), and the plan-ahead
of the next epoch.
May import ``loaderd.stream``, ``loaderd.fleet``, ``loaderd.shm``, ``loaderd.channel``
and the shared layers; never ``loaderd.loader`` (the loader hands an epoch what it
needs) nor ``loaderd.server``.
"""
