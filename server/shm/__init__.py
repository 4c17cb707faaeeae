"""Shared-memory segments on the daemon's host: their names, sizes, mappings and sweeping.

``arena`` names and sizes the segments workers write batches into, maps them for the
daemon (``SlotReader``) and sweeps what a dead daemon left. The worker's writer
(``loaderd.server.worker.slot_writer``) and the daemon's owner of a slot's lifetime
(``loaderd.server.scheduling.ledger``) build on it. May import
``loaderd.server.process`` and the shared layers.
"""
