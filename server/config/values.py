"""The config's value types and the ``Section`` base: each type with the words its errors read in (messages.py).

document.py declares the config's sections with them; the JSON Schema for editors comes from the same types.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from loaderd.server.config.messages import expected, fail, refuse_unknown_keys, says
from loaderd.wire.limits import MAX_CHUNK_BYTES

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LogFormat = Literal["text", "json"]  # log_format.py's LOG_FORMATS (a unit test keeps them equal)
BuildMode = Literal["per_worker", "once"]

# ------------------------------------------------------------------ the values' types, each with its words

_AT_LEAST = "must be at least {ge}, got {input}"
AtLeast0 = Annotated[int, Field(ge=0), says("an integer", greater_than_equal=_AT_LEAST)]
AtLeast1 = Annotated[int, Field(ge=1), says("an integer", greater_than_equal=_AT_LEAST)]
# A worker's item threads: past a few dozen, threads only contend for the GIL and the batch's memory.
MAX_THREADS = 64


def _a_count_or_auto(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        fail(expected("an integer or 'auto'", value), value=value)
    if not 1 <= value <= MAX_THREADS:
        fail(f"must be from 1 to {MAX_THREADS}, or 'auto', got {value}", value=value)
    return value


# A count, or "auto": the worker sizes it from the items/s it measures (server/worker/thread_sizer.py).
Threads = Annotated[
    int | Literal["auto"],
    BeforeValidator(_a_count_or_auto, json_schema_input_type=Annotated[int, Field(ge=1, le=MAX_THREADS)] | Literal["auto"]),
]
ChunkBytes = Annotated[
    int, Field(ge=1, le=MAX_CHUNK_BYTES), says("an integer", greater_than_equal=_AT_LEAST, less_than_equal="at most {le} (16 MiB), got {input}")
]
# Seconds: positive, and under 1e9 (~31 years: anything longer is a typo).
_SECONDS = "expected a positive number of seconds, got {input!r}"
Seconds = Annotated[float, Field(gt=0, lt=1e9), says(otherwise=_SECONDS)]
SecondsOrZero = Annotated[float, Field(ge=0, lt=1e9), says(otherwise=_SECONDS)]
# A keepalive period: at least a second (a ping flood otherwise), at most a day (gRPC takes milliseconds as a 32-bit int).
KeepaliveSeconds = Annotated[float, Field(ge=1, le=86400), says(otherwise="expected seconds from 1 to 86400, got {input!r}")]
Port = Annotated[int, Field(ge=0, le=65535), says("a port number", otherwise="must be a port number from 0 to 65535, got {input}")]
Flag = Annotated[bool, says("true or false")]
# A file, relative to the config's directory; \S: not blank.
PathText = Annotated[str, Field(pattern=r"\S"), says("a file path", string_pattern_mismatch="must not be empty")]
Host = Annotated[str, Field(pattern=r"\S"), says("a host name or IP address", string_pattern_mismatch="must not be empty")]
# "module:attribute", both non-empty; the attribute may be dotted (Outer.Inner).
ImportPath = Annotated[
    str,
    Field(pattern=r"^[^:]+:[\s\S]"),
    says("an import path 'module:attribute'", string_pattern_mismatch="{input!r} is not of the form 'module:attribute'"),
]


def _falsy_is_none(value: Any) -> Any:
    return value or None  # `collate_fn:`, '' (and, as ever, any false value): none


OptionalImportPath = Annotated[ImportPath | None, BeforeValidator(_falsy_is_none, json_schema_input_type=ImportPath | None)]


def _one_of(choices: Any) -> str:
    return f"expected one of {', '.join(get_args(choices))}, got {{input!r}}"


Build = Annotated[BuildMode, says(literal_error=_one_of(BuildMode))]

# A size in bytes: an integer, or a number with a unit ("4GiB", "512 MB"); kB/MB/GB/TB are powers of 1000.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_PATTERN = r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?[bB]|[bB])?\s*$"
MIN_CACHE_BYTES = 1 << 20  # an LMDB environment smaller than this holds next to nothing


def _size_in_bytes(value: Any) -> Any:
    if not isinstance(value, str):
        return value  # an integer is checked as one; anything else is refused by its type
    match = re.match(_SIZE_PATTERN, value)
    if match is None:
        fail(f"{value!r} is not a size (an integer number of bytes, or a number with a unit: 512MiB, 4GiB, 2GB)", value=value)
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


Bytes = Annotated[
    int,
    Field(ge=MIN_CACHE_BYTES),
    BeforeValidator(_size_in_bytes),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": MIN_CACHE_BYTES}, {"type": "string", "pattern": _SIZE_PATTERN}]}),
    says("a size in bytes (an integer, or a string such as '4GiB')", greater_than_equal="must be at least {ge} bytes (1 MiB), got {input}"),
]
LogFormatName = Annotated[LogFormat, says(literal_error=_one_of(LogFormat))]


def _caseless(words: tuple[str, ...]) -> str:
    """A JSON Schema pattern for ``words`` in any case (ECMA regexes have no (?i))."""
    return "^(" + "|".join("".join(f"[{c}{c.lower()}]" for c in word) for word in words) + ")$"


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value  # any case in the file; the type is checked next


LogLevel = Annotated[
    str,
    Field(pattern=f"^({'|'.join(LOG_LEVELS)})$"),
    BeforeValidator(_upper),
    WithJsonSchema({"type": "string", "pattern": _caseless(LOG_LEVELS)}),
    says("a logging level name", string_pattern_mismatch="{input!r} is not one of " + ", ".join(LOG_LEVELS)),
]

# ------------------------------------------------------------------ the sections


class Section(BaseModel):
    """A mapping in the config: its declared keys only (an unknown one refused with a guess), each of its type."""

    # strict: no "4" for 4, no true for 1, no 2.0 for 2.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unknown_keys(data, cls.model_fields)
        return data
