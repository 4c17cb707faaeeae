"""Reaching a daemon: credentials, channels, and what a failed call means.

The lowest client layer: ``Credentials`` and ``open_channel`` (TLS files, bearer
token), ``rpc_errors``, the one place a failed gRPC call becomes a loaderd error, and
``threads``, the registry of every thread the client starts, joined at exit, and
``closer``, the thread that closes what a dropped object left open (never its finalizer).
Imports only the shared layers (``loaderd.wire``, ``loaderd.errors``, ``loaderd.v1``).
The daemon's command line (``loaderd.server.app``) borrows it for ``loaderd status``.
"""
