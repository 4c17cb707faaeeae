"""The daemon's process plumbing: log format, glibc heap settings and tunables, log throttling.

Leaf utilities every daemon layer may import; imports only the standard library and
the shared layers.
"""
