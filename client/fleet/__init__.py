"""The daemons a loader may use: one connection per (process, daemon), probing, placement.

Owns ``Fleet`` (what each daemon last said, which are usable) and its ``FleetMonitor``
thread, ``Member`` (one daemon as the loader knows it, and when to ask it again) and
``DaemonConnection`` (one channel and its unary calls per process and daemon). May import
``loaderd.shm``, ``loaderd.channel`` and the shared layers.
"""
