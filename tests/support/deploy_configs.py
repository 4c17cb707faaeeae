"""Checks for the example configs in deploy/: the listen/auth/metrics contract, then loaderd's own parser.

The deploy configs use listen entries as mappings (``address`` with
``socket_mode``/``socket_group``, ``tls`` or ``insecure``), ``auth.token_file``
and ``metrics.require_token``. ``check_contract`` checks those parts against
that format; ``parse_with_loaderd`` runs the whole file through
``loaderd.server.config.schema.load_config``. A parser that predates the format (it
refuses a mapping listen entry) gets the file with those parts reduced to what
it knows (listen addresses as strings, no ``auth``, no ``require_token``), so
datasets, limits and the rest are still checked by the real parser; a parser
that knows the format gets the file as written, with its TLS and token paths
pointed at stand-in files in a temporary directory (they name
/etc/loaderd/... as deployed).
"""

from __future__ import annotations

import copy
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loaderd.server.config.schema import ConfigError, LoaderConfig, load_config, parse_config

LISTEN_KEYS = {"address", "socket_mode", "socket_group", "tls", "insecure"}
TLS_KEYS = {"cert", "key", "client_ca"}
AUTH_KEYS = {"token_file"}
METRICS_KEYS = {"host", "port", "require_token"}
LOOPBACK_HOSTS = ("127.", "localhost:", "[::1]:")
# Not a real certificate: enough for code that only checks a file looks like PEM.
STAND_IN_PEM = "-----BEGIN CERTIFICATE-----\nc3RhbmQtaW4=\n-----END CERTIFICATE-----\n"


@dataclass(frozen=True)
class Listener:
    """One ``listen:`` entry, as the contract reads it."""

    address: str
    socket_mode: int | None = None
    socket_group: str | None = None
    tls: dict[str, str] | None = None
    insecure: bool = False

    @property
    def unix(self) -> bool:
        return self.address.startswith("unix:")

    @property
    def socket_path(self) -> str:
        assert self.unix
        return self.address[len("unix://") :] if self.address.startswith("unix://") else self.address[len("unix:") :]

    @property
    def port(self) -> int:
        assert not self.unix
        return int(self.address.rsplit(":", 1)[1])

    @property
    def loopback(self) -> bool:
        return self.unix or self.address.startswith(LOOPBACK_HOSTS)


def _listener(entry: Any, where: str) -> Listener:
    if isinstance(entry, str):
        entry = {"address": entry}
    assert isinstance(entry, dict), f"{where}: a string or a mapping"
    assert set(entry) <= LISTEN_KEYS, f"{where}: unknown keys {sorted(set(entry) - LISTEN_KEYS)}"
    address = entry.get("address")
    assert isinstance(address, str) and address, f"{where}: needs an address"
    listener = Listener(
        address=address,
        socket_mode=entry.get("socket_mode"),
        socket_group=entry.get("socket_group"),
        tls=entry.get("tls"),
        insecure=entry.get("insecure", False),
    )
    if listener.unix:
        assert listener.tls is None and not listener.insecure, f"{where}: tls/insecure are for TCP addresses"
        assert listener.socket_path.startswith("/"), f"{where}: an absolute socket path"
        if listener.socket_mode is not None:
            mode = listener.socket_mode
            assert isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o777, f"{where}: socket_mode"
            assert not mode & 0o007, f"{where}: socket_mode {mode:o} lets every user in"
        if listener.socket_group is not None:
            assert isinstance(listener.socket_group, str) and listener.socket_group, f"{where}: socket_group"
    else:
        assert listener.socket_mode is None and listener.socket_group is None, f"{where}: socket_* are for unix sockets"
        assert isinstance(listener.insecure, bool), f"{where}: insecure is a boolean"
        assert not (listener.tls and listener.insecure), f"{where}: tls and insecure together"
        if listener.tls is not None:
            tls = listener.tls
            assert isinstance(tls, dict) and set(tls) <= TLS_KEYS, f"{where}: tls keys are {sorted(TLS_KEYS)}"
            assert {"cert", "key"} <= set(tls), f"{where}: tls needs cert and key"
            assert all(isinstance(p, str) and p.startswith("/") for p in tls.values()), f"{where}: absolute tls paths"
        elif not listener.loopback:
            assert listener.insecure, f"{where}: plaintext TCP on {address} is refused without insecure: true"
    return listener


def check_contract(raw: dict[str, Any]) -> list[Listener]:
    """The config's listeners; AssertionError naming what breaks the format."""
    listen = raw.get("listen")
    entries = [listen] if isinstance(listen, (str, dict)) else listen
    assert isinstance(entries, list) and entries, "listen: one or more entries"
    listeners = [_listener(entry, f"listen[{i}]") for i, entry in enumerate(entries)]
    assert len({lst.address for lst in listeners}) == len(listeners), "listen: an address twice"
    if "auth" in raw:
        auth = raw["auth"]
        assert isinstance(auth, dict) and set(auth) <= AUTH_KEYS, f"auth: keys are {sorted(AUTH_KEYS)}"
        assert isinstance(auth.get("token_file"), str) and auth["token_file"].startswith("/"), "auth.token_file: an absolute path"
    if raw.get("metrics") is not None:
        metrics = raw["metrics"]
        assert isinstance(metrics, dict) and set(metrics) <= METRICS_KEYS, f"metrics: keys are {sorted(METRICS_KEYS)}"
        assert isinstance(metrics.get("require_token", False), bool), "metrics.require_token is a boolean"
        if metrics.get("require_token"):
            assert "auth" in raw, "metrics.require_token needs auth.token_file"
    return listeners


def parser_knows_contract() -> bool:
    """Whether this checkout's parser accepts a mapping listen entry (the contract's format)."""
    probe = {"listen": [{"address": "unix:///tmp/loaderd-probe.sock"}], "datasets": {"d": {"dataset": "m:a"}}}
    try:
        parse_config(probe, Path("/tmp/probe.yaml"))
    except ConfigError:
        return False
    return True


def _reduced(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` in the format of a parser that predates the contract."""
    reduced = copy.deepcopy(raw)
    reduced["listen"] = [listener.address for listener in check_contract(raw)]
    reduced.pop("auth", None)
    if isinstance(reduced.get("metrics"), dict):
        reduced["metrics"].pop("require_token", None)
    return reduced


def _with_stand_in_files(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """``raw`` with its TLS and token paths moved under ``root``, where stand-in files are written."""
    moved = copy.deepcopy(raw)

    def stand_in(path: str, text: str) -> str:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        os.chmod(target, 0o600)
        return str(target)

    for entry in moved["listen"]:
        if isinstance(entry, dict) and entry.get("tls"):
            entry["tls"] = {k: stand_in(v, STAND_IN_PEM) for k, v in entry["tls"].items()}
    if "auth" in moved:
        moved["auth"]["token_file"] = stand_in(moved["auth"]["token_file"], f"probe:{secrets.token_hex(16)}\n")
    return moved


def parse_with_loaderd(text: str, path: Path, scratch: Path) -> LoaderConfig:
    """``text`` (a config written for ``path``) through loaderd's load_config, as the module docstring says."""
    raw = yaml.safe_load(text)
    check_contract(raw)
    if parser_knows_contract():
        raw = _with_stand_in_files(raw, scratch)
    else:
        raw = _reduced(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)
