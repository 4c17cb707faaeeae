"""The wire layer both sides of loaderd import: what crosses the socket and shared memory.

- ``loaderd.wire.codec``: a batch <-> a ``Value`` tree plus one payload of array bytes.
- ``loaderd.wire.framing``: ``StreamResponse`` messages written (daemon) and read
  (client) straight from/to payload bytes, with one tag table.
- ``loaderd.wire.mapping``: shared mappings of segment files that hold no descriptor.
- ``loaderd.wire.limits``: constants both sides must agree on (message cap,
  shared-memory naming).
- ``loaderd.wire.names``: finding a class the process already imported, by name.

Nothing here imports the client's own modules or the daemon's: ``loaderd.wire``
sits under both, next to ``loaderd.errors`` and the generated ``loaderd.v1``.
"""
