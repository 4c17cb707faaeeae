"""The daemon's process plumbing: log format, glibc heap settings and tunables, log throttling, and what the host
or its cgroup gives the daemon (``host_memory``: memory available; ``host_cpu``: CPUs it may use, CPU left idle).

``multiprocessing_private`` is the one module that touches multiprocessing's private internals
(the fork server's pid and handle, its environment, a child started without a Process object),
and says why loaderd keeps multiprocessing's fork server rather than its own.

Leaf utilities every daemon layer may import; imports only the standard library and
the shared layers.
"""
