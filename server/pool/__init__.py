"""The persistent worker processes: their fork server, their pipes, their starts and deaths.

``pool.WorkerPool`` only moves messages (its events and ``WorkerState`` are defined there);
``fork_server.ForkServer`` starts the workers' fork server and every worker's first start
(``PoolStartError``); ``worker_handle.WorkerHandle`` is the pool's record of one worker
process; ``selector.PoolSelector`` the one selector ``poll`` waits on; ``task_pipe.TaskPipe``
never blocks the scheduler. What it needs of multiprocessing beyond the public API is in
``loaderd.server.process.multiprocessing_private``. May import ``loaderd.server.worker``
(its entry point, messages and the fork server's preload payload, never its torch-importing
modules at import time), ``shm``, ``config``, ``process`` and the shared layers.
"""
