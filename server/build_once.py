"""Imported by the pool's fork server only (a preload, before the config's modules): applies the
config's ``python_path`` there and builds the ``build: once`` datasets.

See ``loaderd.server.prebuilt``. The import is the whole point: multiprocessing's
fork server runs no code of ours but the modules it preloads.
"""

from loaderd.server.prebuilt import build_from_environment

build_from_environment()
