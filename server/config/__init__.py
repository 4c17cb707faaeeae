"""The daemon's config: the YAML schema, its validation, and the check that its callables import.

Every error names its culprit (file, key, value). May import ``loaderd.server.process``
and the shared layers, nothing else of the daemon; pool workers import it, so it
imports no grpc and loads yaml only inside ``load_config``.
"""
