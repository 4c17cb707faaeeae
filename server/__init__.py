"""The loaderd daemon, one package per layer (top to bottom; each imports only those below it).

- ``app``: the ``loaderd`` commands, the wiring (``Daemon``), signals, shutdown.
- ``ops``: status snapshot, Prometheus metrics, sd_notify.
- ``rpc``: the gRPC servicer, request checks, sessions, admission, watchdog.
- ``security``: tokens, mTLS, TLS credentials, listeners.
- ``scheduling``: the scheduler, its dispatcher and worker supervisor, producers (client
  streams, shared jobs), the slot ledger.
- ``pool``: the persistent worker processes and their pipes.
- ``worker``: what runs in the workers (the only layer that imports torch or user code)
  and the messages they exchange with the daemon.
- ``shm``: shared-memory segments: names, sizes, mappings, sweeping (the worker writes slots).
- ``config``: the YAML config, validated.
- ``process``: log format, heap and glibc settings, log throttling, and every use of
  multiprocessing's private internals (``multiprocessing_private``, with why).

The daemon imports none of the client's packages (only ``app`` does, for ``loaderd
status`` and ``loaderd bench``); both sides share ``loaderd.wire``, ``loaderd.errors``
and the generated ``loaderd.v1``. pyproject.toml's ``importlinter`` contracts check it.
"""
