"""Feeding the pool fairly: the scheduler, the producer contract, client streams, shared jobs.

Owns dispatch (``Scheduler``), what it dispatches from (``Producer``: ``BatchStream``,
``SharedJob``), the daemon's slot ledger, the catalog of what it serves and the per-client tally. Imports no grpc: its
errors carry a loaderd reason the RPC layer maps. May import ``loaderd.server.pool``,
``worker`` (messages, seeding), ``shm``, ``config``, ``process`` and the shared layers.
"""
