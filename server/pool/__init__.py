"""The persistent worker processes: their fork server, their pipes, their starts and deaths.

``WorkerPool`` only moves messages; ``TaskPipe`` never blocks the scheduler. What it needs of
multiprocessing beyond the public API is in ``loaderd.server.process.multiprocessing_private``. May import
``loaderd.server.worker`` (its entry point and messages, never its torch-importing
modules at import time), ``shm``, ``config``, ``process`` and the shared layers.
"""
