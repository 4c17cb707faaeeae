"""The config's own code: its ``python_path`` applied, and the callables it names imported.

With ``prebuilt`` (the fork server's preload of the config's modules), the only code of the
daemon's that imports a user's module. The daemon never calls it in its own process (its
import check forks a child, server/worker/import_check.py); the fork server, the workers,
``loaderd check`` and ``loaderd bench`` do.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from loaderd.errors import clip
from loaderd.server.config.schema import ConfigError, LoaderConfig
from loaderd.wire.limits import IMPORTING_CONFIG_ENV

_LOADERD_DIRS = (str(Path(__file__).resolve().parent.parent) + "/",)  # loaderd.server's own files


def user_error(exc: BaseException, limit: int | None = None) -> str:
    """``Type: message (at file:line)``: a user's exception in one line, the message clipped to ``limit``
    characters if given. The place is the innermost frame of its traceback outside loaderd's daemon (the
    user's code, or a library it called); none where there is no such frame (a constructor called with
    arguments it does not take fails in loaderd's own call). ``serve`` (a starting pool, the fork server's
    ``build: once``), ``check`` and ``bench`` word a user's failure with it."""
    message = str(exc) if limit is None else clip(str(exc), limit)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_LOADERD_DIRS)]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {message}{where}"


def apply_python_path(python_path: Sequence[str]) -> None:
    """Prepend a config's ``python_path`` to sys.path (daemon, fork server and workers alike)."""
    for entry in reversed(python_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


@contextlib.contextmanager
def _importing(module_name: str) -> Iterator[None]:
    """``IMPORTING_CONFIG_ENV`` names the module while it is imported (a loader made then refuses; see there)."""
    before = os.environ.get(IMPORTING_CONFIG_ENV)
    os.environ[IMPORTING_CONFIG_ENV] = module_name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(IMPORTING_CONFIG_ENV, None)
        else:
            os.environ[IMPORTING_CONFIG_ENV] = before


def import_config_module(module_name: str) -> ModuleType:
    """Import a module the config names (the fork server's preload, ``resolve``), flagged as such."""
    with _importing(module_name):
        return importlib.import_module(module_name)


def resolve(import_path: str) -> Callable[..., Any]:
    """Import 'module:attr' (attr may be dotted). Raises ConfigError naming it."""
    module_name, _, attr = import_path.partition(":")
    try:
        obj: Any = import_config_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user's module may raise anything on import: the error names it
        raise ConfigError(f"cannot import module {module_name!r} (from {import_path!r}): {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (from {import_path!r})") from None
    if not callable(obj):
        raise ConfigError(f"{import_path!r} is not callable")
    return obj


def check_imports(config: LoaderConfig) -> None:
    """Import every callable the config names, so a typo fails before any worker starts."""
    apply_python_path(config.python_path)
    for spec in config.datasets.values():
        named = (("dataset", spec.factory), ("collate_fn", spec.collate_fn), ("worker_init_fn", spec.worker_init_fn), ("transform", spec.transform))
        for key, value in named:
            if value is None:
                continue
            try:
                resolve(value)
            except ConfigError as exc:
                raise ConfigError(f"datasets.{spec.name}.{key}: {exc}") from None
