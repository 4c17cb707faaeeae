"""Imported by the pool's fork server only (a preload): applies the config's ``python_path``
there, imports the config's modules once for the pool and builds the ``build: once`` datasets.

See ``loaderd.server.worker.prebuilt``. The import is the whole point: multiprocessing's
fork server runs no code of ours but the modules it preloads.
"""

from loaderd.server.worker.prebuilt import build_from_environment

build_from_environment()
