"""Feeding the pool fairly: the scheduler, the producer contract, client streams, shared jobs.

Owns the scheduler's thread and routing (``Scheduler``), dispatch (``Dispatcher``: round-robin,
what each worker holds, blame for deaths), keeping the pool's slots filled (``WorkerSupervisor``
acting on ``WorkerLifecycle``'s states), an elastic pool's size (``PoolSizer``: the policy;
``ElasticPool``: measuring and applying it), what it dispatches from (``Producer``: ``BatchStream``,
``SharedJob``), the daemon's slot ledger, the catalog of what it serves, the per-client tally,
and ``SchedulerSnapshot`` (what status and metrics read, copied under the lock). ``pool_protocol``
says what it needs of the pool; ``task_errors`` words a batch it gave up on, ``task_deadlines`` gives up on those past their
``task_timeout``; ``wake_pipe``
wakes its thread. Imports no grpc: its
errors carry a loaderd reason the RPC layer maps. May import ``loaderd.server.pool``,
``worker`` (messages, seeding), ``shm``, ``config``, ``process`` and the shared layers.
"""
