"""What runs in the pool's processes, and the messages they exchange with the daemon.

``worker.run_worker`` is a worker process's life and its task loop; ``datasets`` builds the
config's datasets as a worker holds them; ``batches.BatchMaker`` makes a task's batch and
sends it; ``entry`` is the frozen ``WorkerSpec`` and the entry point the daemon names
(importing no torch); ``tasks`` the messages (and ``send_result``); ``seeding`` per-batch
seeds; ``slot_writer``/``slot_collate`` a batch collated straight into the worker's
shared-memory slots; ``user_code`` the config's own code imported; ``import_check`` the
daemon's first check of it, in a forked child; ``prebuilt``/``build_once`` the ``build:
once`` datasets built in the fork server. The only daemon layer that imports torch or
the config's own code. May import ``loaderd.server.cache`` (the item cache a dataset's
``cache:`` asks for), ``shm``, ``config``, ``process`` and the shared layers.
"""
