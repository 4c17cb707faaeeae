"""Streams from one daemon: the ``StreamBatches`` call, an epoch's lane on it, received memory.

Owns the calls and what arrives on them: ``StreamCall`` (one call, epoch after epoch),
``Lane`` (one epoch's share of a call), the kinds of news a lane posts (``Heard``), the
buffers gRPC batches are received into and the one nudge to glibc's heap that receiving needs. May import ``loaderd.fleet``,
``loaderd.shm``, ``loaderd.channel`` and the shared layers.
"""
