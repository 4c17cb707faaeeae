"""The resume state of a RemoteDataLoader: a small, JSON-able record and its validation.

``RemoteDataLoader.state_dict()`` returns ``LoaderState.to_dict()``; a loader
in another process (after a daemon restart, with another pool size) turns it
back with ``LoaderState.from_dict`` and replays the epoch's start from it. The
record holds no pickle and no tensors, only str/int/bool/None and lists of
them, so ``json.dumps`` takes it as is:

=================  ==========================================================
``version``        ``STATE_VERSION``; other versions are refused.
``dataset``        the daemon's dataset name.
``fingerprint``    the loader parameters that decide its batches
                   (``LoaderIdentity.fingerprint()``); must match on load.
``epoch``          the loader's epoch counter: the epoch in progress, or
                   (``yielded`` null) the epoch that starts next.
``yielded``        batches the epoch in progress handed out (errors count);
                   null between epochs.
``base_seed``      the epoch's base seed (null between epochs); a replay must
                   draw it again, which checks the replay.
``rng``            state of the RNG the epoch draws from (the loader's
                   ``generator``, else torch's default generator), zlib'ed and
                   base64'd: at the epoch's start when mid-epoch; between
                   epochs only for an explicit ``generator``, as it is now.
                   Null for share loaders (their RNG is seeded per epoch).
``sampler_rngs``   the same for generators the samplers own (e.g.
                   ``SubsetRandomSampler(generator=g)``), in discovery order.
``sampler_epochs`` the ``epoch`` of each sampler with ``set_epoch`` (e.g.
                   ``DistributedSampler``), in discovery order.
=================  ==========================================================
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

STATE_VERSION = 1


def encode_rng(state: torch.Tensor) -> str:
    """A generator's ``get_state()`` as text (zlib: the state is half padding, ~4 KiB instead of 7)."""
    return base64.b64encode(zlib.compress(state.numpy().tobytes(), 9)).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """The ``get_state()`` tensor that ``encode_rng`` wrote; ValueError if ``text`` is not one."""
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise ValueError(f"not an encoded generator state ({exc})") from None
    state = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        torch.Generator().set_state(state)  # the generator checks size and contents
    except RuntimeError as exc:
        raise ValueError(f"not a torch CPU generator state ({exc})") from None
    return state


@dataclass(frozen=True)
class LoaderState:
    """One loader's position (see the module docstring for the fields)."""

    dataset: str
    fingerprint: str
    epoch: int
    yielded: int | None = None
    base_seed: int | None = None
    rng: str | None = None
    sampler_rngs: list[str] = field(default_factory=list)
    sampler_epochs: list[int | None] = field(default_factory=list)

    @property
    def mid_epoch(self) -> bool:
        return self.yielded is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps``; ``version`` first."""
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """Validate ``state`` (as ``to_dict`` wrote it, possibly through JSON); ValueError naming the problem."""
        if not isinstance(state, dict):
            raise ValueError(f"malformed loader state: expected a dict, got {type(state).__name__}")
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(
                f"unknown loader state version {version!r}: this loaderd reads version {STATE_VERSION}"
                if "version" in state
                else "malformed loader state: no 'version' key (not a RemoteDataLoader.state_dict())"
            )
        expected = {"version", *cls.__dataclass_fields__}
        missing = sorted(expected - state.keys())
        unknown = sorted(state.keys() - expected, key=str)
        if missing or unknown:
            parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
                [f"unknown {', '.join(map(repr, unknown))}"] if unknown else []
            )
            raise ValueError(f"malformed loader state: {'; '.join(parts)}")
        loaded = cls(
            dataset=_check(state, "dataset", str),
            fingerprint=_check(state, "fingerprint", str),
            epoch=_check_count(state, "epoch"),
            yielded=None if state["yielded"] is None else _check_count(state, "yielded"),
            base_seed=None if state["base_seed"] is None else _check(state, "base_seed", int),
            rng=None if state["rng"] is None else _check_rng(state["rng"], "rng"),
            sampler_rngs=[_check_rng(r, f"sampler_rngs[{i}]") for i, r in enumerate(_check(state, "sampler_rngs", list))],
            sampler_epochs=[
                None if e is None else _check_count({f"sampler_epochs[{i}]": e}, f"sampler_epochs[{i}]")
                for i, e in enumerate(_check(state, "sampler_epochs", list))
            ],
        )
        if loaded.mid_epoch != (loaded.base_seed is not None):
            raise ValueError("malformed loader state: 'base_seed' must be set exactly when 'yielded' is")
        return loaded

    def check_fits(
        self,
        *,
        dataset: str,
        fingerprint: str,
        sampler_rngs: int,
        sampler_epochs: int,
        rng: bool,
        epoch_length: int | None,
    ) -> None:
        """ValueError unless this state can resume a loader with these properties.

        ``rng``: whether the loader needs an RNG state from it; ``epoch_length``:
        batches per epoch, where known (map-style, sized sampler).
        """
        if self.dataset != dataset:
            raise ValueError(f"the loader state is of dataset {self.dataset!r}; this loader reads {dataset!r}")
        if self.fingerprint != fingerprint:
            raise ValueError(
                f"the loader state was taken from a loader with other parameters: [{self.fingerprint}]; "
                f"this loader has [{fingerprint}]"
            )
        if len(self.sampler_rngs) != sampler_rngs or len(self.sampler_epochs) != sampler_epochs:
            raise ValueError(
                f"the loader state holds {len(self.sampler_rngs)} sampler generator(s) and "
                f"{len(self.sampler_epochs)} sampler epoch(s); this loader's samplers have "
                f"{sampler_rngs} and {sampler_epochs}"
            )
        if rng and self.rng is None:
            raise ValueError("the loader state has no generator state where this loader needs one")
        if not rng and self.rng is not None:
            raise ValueError(
                "the loader state holds a generator state where this loader has none to restore "
                "(a share, or generator=None between epochs)"
            )
        if self.yielded is not None and epoch_length is not None and self.yielded > epoch_length:
            raise ValueError(f"the loader state says {self.yielded} batches were yielded; an epoch has {epoch_length}")


def _check(state: dict[str, Any], key: str, kind: type) -> Any:
    value = state[key]
    # bool is an int to isinstance; a state never holds one where an int belongs.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"malformed loader state: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _check_count(state: dict[str, Any], key: str) -> int:
    value = _check(state, key, int)
    if value < 0:
        raise ValueError(f"malformed loader state: {key!r} must be >= 0, got {value}")
    return value


def _check_rng(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"malformed loader state: {key!r} must be str, got {type(value).__name__}")
    try:
        decode_rng(value)
    except ValueError as exc:
        raise ValueError(f"malformed loader state: {key!r} is {exc}") from None
    return value
