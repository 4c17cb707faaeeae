"""The config's errors in loaderd's words: one line naming the key, the value and what was expected.

pydantic finds what is wrong (``document.py`` declares the types); this module words it.
A type says how its own errors read (``says``); ``config_error`` turns the first error of
a ``ValidationError`` into the ``ConfigError`` that ``loaderd serve`` and ``loaderd check``
print. Imported only while a config is parsed: never by the pool's processes.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import InitErrorDetails, PydanticCustomError

from loaderd.server.config.schema import ConfigError

# loaderd's own errors: their message is final (``config_error`` only puts the key path in front).
_WORDED = "loaderd"


def _worded(text: str) -> PydanticCustomError:
    # The text goes in as context: pydantic would read braces in a message template (a dict value's repr) as fields.
    return PydanticCustomError(_WORDED, "{text}", {"text": text})


def _is_type_error(error: Any) -> bool:
    """Whether pydantic refused the value's type (``int_type``, ``model_type``, ... or a union's ``none_required``)."""
    kind: str = error["type"]
    return kind.endswith("_type") or kind == "none_required"


def expected(what: str, value: Any) -> str:
    """The words for a value of the wrong type: ``expected a list, got str 'abc'``."""
    return f"expected {what}, got {type(value).__name__} {value!r}"


def says(what: str | None = None, **templates: str) -> WrapValidator:
    """How the errors of the value it annotates read (not those of the keys and items inside it).

    A wrong type reads ``expected(what, value)``; an error pydantic types ``kind``
    (``greater_than_equal``, ``literal_error``, ...) reads ``templates[kind]``, formatted
    with the error's context and ``input`` (the value refused); ``otherwise`` stands for any
    kind not named. The last of an ``Annotated``'s metadata, so that it sees every error.
    """

    def words(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            errors = exc.errors()
            # A union's members each refuse the value under their own name: ("str",), ("int",).
            if not all(e["loc"] == () or (len(e["loc"]) == 1 and e["input"] is value and _is_type_error(e)) for e in errors):
                raise  # an error of a key or an item: its own type words it
            first = errors[0]
            if first["type"] == _WORDED:
                raise  # already in loaderd's words (a check inside the type)
            if what is not None and _is_type_error(first):
                raise _worded(expected(what, value)) from None
            template = templates.get(first["type"], templates.get("otherwise"))
            if template is None:
                raise
            raise _worded(template.format(input=first["input"], **first.get("ctx", {}))) from None

    return WrapValidator(words)


def fail(text: str, *loc: str | int, value: Any = None) -> NoReturn:
    """Refuse with ``text``, as the error of ``loc`` (a key under the model being validated, or none)."""
    detail: InitErrorDetails = {"type": _worded(text), "loc": loc, "input": value}
    raise ValidationError.from_exception_data("config", [detail])


def refuse_unknown_keys(got: dict[Any, Any], allowed: Collection[str]) -> None:
    """Refuse the first key not in ``allowed``, with the allowed ones and the likeliest meant."""
    unknown = sorted(set(got) - set(allowed), key=str)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _worded(f"unknown key {key!r} ({hint}allowed: {', '.join(sorted(allowed))})")


# pydantic names a union's member in an error's location: a validated model reads "function-after[_check(), Section]".
_UNION_MEMBER = re.compile(r"^function-(after|before|wrap|plain)\[.*\]$")


def _where(loc: tuple[str | int, ...], root: str) -> str:
    """``loc`` as the config writes it (``listen[0].tls``, ``datasets.train``); ``root`` for the document itself."""
    parts = []
    for i, key in enumerate(loc):
        if key == "[key]":  # pydantic's mark for a mapping's key (a dataset's name), after the key itself
            continue
        if isinstance(key, str) and _UNION_MEMBER.match(key):  # which member of a union refused: not a key of the file
            continue
        mapping_key = i + 1 < len(loc) and loc[i + 1] == "[key]"
        parts.append(f"[{key}]" if isinstance(key, int) and not mapping_key else f".{key}")
    return "".join(parts).removeprefix(".") or root


def config_error(exc: ValidationError, root: str | Path) -> ConfigError:
    """The first of pydantic's errors as one line: ``workers: must be at least 1, got 0``.

    ``root`` names the document itself (the config's path) in errors that concern all of it.
    """
    error = exc.errors(include_url=False)[0]
    loc = error["loc"]
    if error["type"] == "missing":
        return ConfigError(f"{_where(loc[:-1], str(root))}: missing required key {loc[-1]!r}")
    # Anything no type words (there should be nothing) still names its key, in pydantic's words.
    return ConfigError(f"{_where(loc, str(root))}: {error['msg']}")
