"""The wire layer both sides of loaderd import: what crosses the socket and shared memory.

- ``loaderd.wire.batch_encoder``: a batch -> a ``Value`` tree plus one payload of array bytes;
  ``loaderd.wire.batch_decoder`` the reverse (assembled from chunks, or views of a slot);
  ``loaderd.wire.dtypes`` the dtype names both use.
- ``loaderd.wire.framing``: ``StreamResponse`` messages written (daemon) and read
  (client) straight from/to payload bytes, with one tag table.
- ``loaderd.wire.mapping``: shared mappings of segment files that hold no descriptor.
- ``loaderd.wire.limits``: constants both sides must agree on (message cap,
  shared-memory naming).
- ``loaderd.wire.names``: finding a class the process already imported, by name.
- ``loaderd.wire.rendezvous``: rendezvous hashing (the daemon a share meets on, the
  slot a displaced iterable replica moves to).
- ``loaderd.wire.addresses``: the address forms both ``RemoteDataLoader`` and
  ``loaderd serve``/``status`` accept (lists, ``dns:///``, loopback checks).
- ``loaderd.wire.reasons``: why a call failed, as a ``google.rpc.ErrorInfo`` reason in its
  status details (the daemon attaches it, the client reads it; no message text is parsed).

Nothing here imports the client's own packages or the daemon's (checked by the
``importlinter`` contracts in pyproject.toml): ``loaderd.wire``
sits under both, next to ``loaderd.errors`` and the generated ``loaderd.v1``.
"""
