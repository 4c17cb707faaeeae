"""The gRPC face of the daemon: the servicer, its requests, sessions and admission.

Thin translation between messages and the parts that own the work: the handler table,
``LoaderServicer``, request checks (``requests``, ``call_requests``), client sessions,
admission and the watchdog that cuts silent calls, the handler thread pool, the drain
flag. With ``app`` and ``security`` (interceptors, credentials, listeners), the only daemon
layer that imports grpc. May import
``loaderd.server.security``, ``scheduling``, ``pool``, ``worker`` (messages only),
``shm``, ``config``, ``process`` and the shared layers.
"""
