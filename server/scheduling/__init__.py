"""Feeding the pool fairly: the scheduler, the producer contract, client streams, shared jobs.

Owns the scheduler's thread and routing (``Scheduler``), dispatch (``Dispatcher``: round-robin,
what each worker holds, blame for deaths), keeping the pool's slots filled (``WorkerSupervisor``
acting on ``WorkerLifecycle``'s states), what it dispatches from (``Producer``: ``BatchStream``,
``SharedJob``), the daemon's slot ledger, the catalog of what it serves and the per-client tally. Imports no grpc: its
errors carry a loaderd reason the RPC layer maps. May import ``loaderd.server.pool``,
``worker`` (messages, seeding), ``shm``, ``config``, ``process`` and the shared layers.
"""
