"""The daemon's config: its runtime classes (schema.py), the file's schema declared with pydantic
(document.py: the sections; values.py: the value types and the Section base), and the one-line
errors that name their culprit (messages.py: file, key, value).

May import ``loaderd.server.process`` and the shared layers, nothing else of the daemon.
Pool workers import schema.py, so it imports no grpc, and loads yaml and pydantic (through
document.py) only inside ``load_config``.
"""
