"""Security against real daemons: TLS, mTLS, tokens, socket modes, sessions bound to their client.

Certificates are made here with trustme (a throwaway CA per module). Two module
daemons: ``secured`` (auth on; unix socket 0600 started under umask 002, a
0660 one, a TLS port, an mTLS port, metrics that need a token) and ``mtls``
(mTLS, no tokens: clients are named by their certificate). Rotation runs on
daemons of its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, loaderd_cli, oracle_loader, popen_serve, wait_serving, write_config
from support.datasets import Squares

from loaderd import AuthenticationError, CredentialsError, LoaderdError, RemoteDataLoader
from loaderd.channel.credentials import Credentials
from loaderd.fleet.connection import get_connection
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc as pb_grpc
from loaderd.wire.limits import PROTOCOL_REVISION

pytestmark = pytest.mark.timeout(120)

N = 64
BATCH = 8
DATASETS = {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": N}}}
TOKENS = {"trainer": "tok-trainer-0123456789", "ops": "tok-ops-9876543210"}
STARTUP_S = 90.0
FAST_S = 10.0  # "at once": well under the loaders' failover_timeout of 60 s


# ------------------------------------------------------------------ certificates


@dataclass
class Pki:
    """PEM files of a CA, the daemon's certificate (127.0.0.1, localhost), a client's, and a stranger's."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path


def write_pki(directory: Path) -> Pki:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trainer-1.example")
    stranger = other.issue_cert("intruder.example")
    paths: dict[str, Path] = {}
    for name, blob in (
        ("ca", ca.cert_pem),
        ("server_cert", server.cert_chain_pems),
        ("server_key", server.private_key_pem),
        ("client_cert", client.cert_chain_pems),
        ("client_key", client.private_key_pem),
        ("other_ca", other.cert_pem),
        ("other_client_cert", stranger.cert_chain_pems),
        ("other_client_key", stranger.private_key_pem),
    ):
        path = paths[name] = directory / f"{name}.pem"
        path.write_bytes(b"".join(b.bytes() for b in blob) if isinstance(blob, list) else blob.bytes())
        path.chmod(0o600)
    return Pki(directory, **paths)


def write_tokens(path: Path, tokens: dict[str, str], mode: int = 0o600) -> Path:
    path.write_text("# name:token\n" + "".join(f"{name}:{token}\n" for name, token in tokens.items()))
    path.chmod(mode)
    return path


# ------------------------------------------------------------------ daemons


@dataclass
class Secured:
    daemon: RunningDaemon
    pki: Pki
    tls: str  # 127.0.0.1:port speaking TLS
    mtls: str  # 127.0.0.1:port requiring a client certificate
    group_socket: Path
    metrics: str


def tcp_addresses(log: str) -> dict[str, str]:
    """{security description: address} from the daemon's 'ADDRESS: how' lines."""
    return {how: address for address, how in re.findall(r"(127\.0\.0\.1:\d+): (TLS[^\n]*)", log)}


@contextlib.contextmanager
def daemon_with(config: dict[str, Any], tmp: Path, umask: int | None = None, **top: Any) -> Iterator[RunningDaemon]:
    """`loaderd serve` on ``config``'s listen entries (the first a unix socket), SERVING when yielded."""
    config_path = write_config(tmp, DATASETS, workers=1, **config, **top)
    log_path = tmp / "daemon.log"
    previous = os.umask(umask) if umask is not None else None
    try:
        process = popen_serve(config_path, log_path)
    finally:
        if previous is not None:
            os.umask(previous)
    first = config["listen"][0]
    socket_path = Path((first if isinstance(first, str) else first["address"]).removeprefix("unix://"))
    daemon = RunningDaemon(process, f"unix://{socket_path}", socket_path, config_path, log_path)
    try:
        wait_serving(daemon.address, process, log_path, STARTUP_S)  # health needs no token
        yield daemon
        if process.poll() is None:
            assert daemon.stop() == 0, daemon.log()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    directory = Path(tempfile.mkdtemp(prefix="ld-pki-", dir="/tmp"))
    yield write_pki(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def secured(pki: Pki) -> Iterator[Secured]:
    tmp = Path(tempfile.mkdtemp(prefix="ld-sec-", dir="/tmp"))
    tokens = write_tokens(tmp / "tokens.txt", TOKENS)
    listen = [
        f"unix://{tmp}/d.sock",
        {"address": f"unix://{tmp}/group.sock", "socket_mode": 0o660},
        {"address": "127.0.0.1:0", "tls": {"cert": str(pki.server_cert), "key": str(pki.server_key)}},
        {
            "address": "127.0.0.1:0",
            "tls": {"cert": str(pki.server_cert), "key": str(pki.server_key), "client_ca": str(pki.ca)},
        },
    ]
    config = {"listen": listen, "auth": {"token_file": str(tokens)}, "metrics": {"port": 0, "require_token": True}}
    try:
        with daemon_with(config, tmp, umask=0o002) as daemon:
            ports = tcp_addresses(daemon.log())
            metrics = re.search(r"metrics on (http://\S+/metrics)", daemon.log())
            assert metrics and len(ports) == 2, daemon.log()
            yield Secured(
                daemon,
                pki,
                tls=ports["TLS"],
                mtls=ports["TLS, client certificates required (mTLS)"],
                group_socket=tmp / "group.sock",
                metrics=metrics.group(1),
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def mtls_only(pki: Pki) -> Iterator[tuple[RunningDaemon, str]]:
    tmp = Path(tempfile.mkdtemp(prefix="ld-mtls-", dir="/tmp"))
    tls = {"cert": str(pki.server_cert), "key": str(pki.server_key), "client_ca": str(pki.ca)}
    try:
        with daemon_with({"listen": [f"unix://{tmp}/d.sock", {"address": "127.0.0.1:0", "tls": tls}]}, tmp) as daemon:
            yield daemon, tcp_addresses(daemon.log())["TLS, client certificates required (mTLS)"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def torch_epoch() -> list[Any]:
    return list(oracle_loader(Squares(N), batch_size=BATCH))


def client_tls(pki: Pki, with_cert: bool = True) -> dict[str, str]:
    tls = {"ca": str(pki.ca)}
    if with_cert:
        tls.update(cert=str(pki.client_cert), key=str(pki.client_key))
    return tls


def refused_fast(what: str, **loader: Any) -> LoaderdError:
    """The error a RemoteDataLoader raises at construction, checked to come well before failover_timeout."""
    t0 = time.monotonic()
    with pytest.raises(LoaderdError) as info:
        RemoteDataLoader("squares", batch_size=BATCH, failover_timeout=60, **loader)
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_S, f"{what}: refused only after {elapsed:.1f}s: {info.value}"
    return info.value


# ------------------------------------------------------------------ TLS and mTLS


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_tls_epoch_equals_torchs(secured: Secured, transport: str) -> None:
    loader = RemoteDataLoader(
        "squares", batch_size=BATCH, address=secured.tls, transport=transport, tls={"ca": str(secured.pki.ca)}, token=TOKENS["trainer"]
    )
    assert_same_batches(list(loader), torch_epoch(), f"over TLS ({transport})")


def test_mtls_epoch_equals_torchs_and_names_the_certificate(mtls_only: tuple[RunningDaemon, str], pki: Pki) -> None:
    daemon, address = mtls_only
    loader = RemoteDataLoader("squares", batch_size=BATCH, address=address, transport="grpc", tls=client_tls(pki))
    it = iter(loader)
    got = [next(it)]
    streams = secured_status(daemon.address).streams
    assert len(streams) == 1 and "trainer-1.example" in streams[0].identity, streams
    got += list(it)
    assert_same_batches(got, torch_epoch(), "over mTLS")
    assert re.search(r"stream \d+ opened by .*trainer-1\.example\)", daemon.log()), daemon.log()


def test_mtls_refuses_a_client_without_a_certificate(mtls_only: tuple[RunningDaemon, str], pki: Pki) -> None:
    _, address = mtls_only
    error = refused_fast("no certificate", address=address, tls=client_tls(pki, with_cert=False))
    assert isinstance(error, AuthenticationError) and isinstance(error, PermissionError)
    assert "client certificate" in str(error) and address in str(error)


def test_mtls_refuses_a_certificate_of_another_ca(mtls_only: tuple[RunningDaemon, str], pki: Pki) -> None:
    _, address = mtls_only
    tls = {"ca": str(pki.ca), "cert": str(pki.other_client_cert), "key": str(pki.other_client_key)}
    error = refused_fast("stranger's certificate", address=address, tls=tls)
    assert isinstance(error, AuthenticationError) and "client certificate" in str(error)


def test_plaintext_against_a_tls_port_fails_clearly_and_fast(secured: Secured) -> None:
    error = refused_fast("plaintext", address=secured.tls, tls=False, token=TOKENS["trainer"])
    assert isinstance(error, AuthenticationError)
    assert "speaks TLS" in str(error) and "tls=" in str(error)


def test_a_daemon_certificate_from_another_ca_fails_clearly_and_fast(secured: Secured) -> None:
    error = refused_fast("wrong CA", address=secured.tls, tls={"ca": str(secured.pki.other_ca)}, token=TOKENS["trainer"])
    assert isinstance(error, AuthenticationError) and "not signed by the CA" in str(error)


def test_tls_to_a_plaintext_port_fails_clearly(start_plaintext_tcp: str, pki: Pki) -> None:
    error = refused_fast("TLS to plaintext", address=start_plaintext_tcp, tls={"ca": str(pki.ca)})
    assert isinstance(error, AuthenticationError) and "does not speak TLS" in str(error)


@pytest.fixture
def start_plaintext_tcp(start_daemon: Any) -> str:
    daemon = start_daemon(DATASETS, workers=1, tcp=True)
    return daemon.extra_addresses[0]


def test_bad_tls_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="tls.ca: cannot read"):
        Credentials.resolve({"ca": str(tmp_path / "missing.pem")})
    with pytest.raises(CredentialsError, match="'cert' and 'key' go together"):
        Credentials.resolve({"cert": str(tmp_path / "c.pem")})
    with pytest.raises(CredentialsError, match="unknown key 'crt'"):
        Credentials.resolve({"crt": "x"})


# ------------------------------------------------------------------ tokens


def secured_status(address: str, token: str | None = None) -> pb.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        metadata = [("authorization", f"Bearer {token}")] if token else None
        return pb_grpc.LoaderStub(channel).Status(pb.StatusRequest(), timeout=10.0, metadata=metadata)


def test_missing_or_wrong_token_is_refused_at_once_and_health_still_answers(secured: Secured) -> None:
    for token in ("", "tok-trainer-0123456788"):
        error = refused_fast(f"token {token!r}", address=secured.daemon.address, token=token)
        assert isinstance(error, AuthenticationError) and isinstance(error, PermissionError), error
        assert ("requires a token" in str(error)) if not token else ("not valid" in str(error))
    for sent in (None, "nope"):
        with pytest.raises(grpc.RpcError) as info:
            secured_status(secured.daemon.address, sent)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(secured.daemon.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # Watch holds a thread for as long as it runs: not without a token
            next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert re.search(r"/loaderd\.v1\.Loader/Status from \S+ refused: the token is not valid", secured.daemon.log())
    assert TOKENS["trainer"][:-1] not in secured.daemon.log()


def test_the_token_names_the_client_in_status_and_logs(secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADERD_TOKEN", TOKENS["ops"])  # the environment is the default
    loader = RemoteDataLoader("squares", batch_size=BATCH, address=secured.daemon.address)
    it = iter(loader)
    got = [next(it)]
    streams = secured_status(secured.daemon.address, TOKENS["trainer"]).streams
    assert [s.identity for s in streams] == ["ops"], streams
    got += list(it)
    assert_same_batches(got, torch_epoch(), "with a token")
    assert "identity: ops" in secured.daemon.log()


def test_loaderd_status_needs_the_token(secured: Secured) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADERD_")}
    refused = loaderd_cli("status", "--address", secured.daemon.address, env=env)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused
    by_flag = loaderd_cli("status", "--address", secured.daemon.address, "--token", TOKENS["ops"], env=env)
    assert by_flag.returncode == 0 and "WORKER" in by_flag.stdout, by_flag
    over_tls = loaderd_cli(
        "status", "--address", secured.tls, "--tls-ca", str(secured.pki.ca), "--json", env={**env, "LOADERD_TOKEN": TOKENS["ops"]}
    )
    assert over_tls.returncode == 0 and '"workers"' in over_tls.stdout, over_tls
    plaintext = loaderd_cli("status", "--address", secured.tls, "--timeout", "5", env={**env, "LOADERD_TOKEN": TOKENS["ops"]})
    assert plaintext.returncode == 1 and "speaks TLS" in plaintext.stderr, plaintext


def test_metrics_need_the_token(secured: Secured) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(secured.metrics, timeout=10)
    assert info.value.code == 401
    request = urllib.request.Request(secured.metrics, headers={"Authorization": f"Bearer {TOKENS['ops']}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200 and b"loaderd_workers" in reply.read()


# ------------------------------------------------------------------ sockets and sessions


def test_unix_sockets_are_private_whatever_the_umask(secured: Secured) -> None:
    assert stat.S_IMODE(secured.daemon.socket_path.stat().st_mode) == 0o600  # started under umask 002
    assert stat.S_IMODE(secured.group_socket.stat().st_mode) == 0o660  # socket_mode: 0660


def test_session_ids_are_unguessable_and_bound_to_their_client(secured: Secured) -> None:
    address = secured.daemon.address
    owner = get_connection(address, Credentials(token=TOKENS["trainer"])).session()
    other = get_connection(address, Credentials(token=TOKENS["ops"])).session()
    assert owner.shm and other.shm
    assert abs(owner.session_id - other.session_id) > 1 << 20, (owner.session_id, other.session_id)
    # Another identity naming the owner's session, here or over TCP: refused like an unknown session.
    assert hijack(address, None, TOKENS["ops"], owner.session_id) == grpc.StatusCode.ABORTED
    creds = grpc.ssl_channel_credentials(secured.pki.ca.read_bytes())
    assert hijack(secured.tls, creds, TOKENS["ops"], owner.session_id) == grpc.StatusCode.ABORTED
    assert "named another client's session" in secured.daemon.log()
    # Its own identity may stream through it (a new connection of the same client, e.g. after a reconnect): the
    # stream is taken and waits for a plan this call never sends, until its deadline (a refusal comes at once).
    assert hijack(address, None, TOKENS["trainer"], owner.session_id, timeout=2) == grpc.StatusCode.DEADLINE_EXCEEDED


def hijack(address: str, creds: grpc.ChannelCredentials | None, token: str, session_id: int, timeout: float = 10) -> grpc.StatusCode:
    """Open a stream naming ``session_id`` from a fresh channel; the code it ends with (OK: it served)."""
    channel = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
    with channel:
        call = pb_grpc.LoaderStub(channel).StreamBatches(
            iter([pb.StreamRequest(open=pb.OpenStream(protocol_revision=PROTOCOL_REVISION, dataset="squares", session_id=session_id, auto_collation=True, batch_size=1))]),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=timeout,
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


# ------------------------------------------------------------------ start-up refusals


def serve_exit(tmp: Path, **config: Any) -> subprocess.CompletedProcess[str]:
    return loaderd_cli("serve", "--config", str(write_config(tmp, DATASETS, workers=1, **config)))


def test_plaintext_on_a_public_address_is_refused(short_tmp: Path) -> None:
    result = serve_exit(short_tmp, listen=[f"unix://{short_tmp}/d.sock", "0.0.0.0:0"])
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "0.0.0.0:0" in lines[0] and "tls:" in lines[0] and "insecure: true" in lines[0], result.stderr


def test_insecure_true_starts_with_a_warning(short_tmp: Path) -> None:
    listen = [f"unix://{short_tmp}/d.sock", {"address": "0.0.0.0:0", "insecure": True}]
    with daemon_with({"listen": listen}, short_tmp) as daemon:
        assert re.search(r"WARNING: 0\.0\.0\.0:\d+ serves PLAINTEXT", daemon.log()), daemon.log()


def test_a_token_file_other_users_can_read_is_refused(short_tmp: Path) -> None:
    tokens = write_tokens(short_tmp / "tokens.txt", TOKENS, mode=0o644)
    result = serve_exit(short_tmp, listen=[f"unix://{short_tmp}/d.sock"], auth={"token_file": str(tokens)})
    assert result.returncode == 2 and "0644" in result.stderr and "chmod 600" in result.stderr, result


def test_a_missing_certificate_is_a_config_error(short_tmp: Path) -> None:
    tls = {"cert": str(short_tmp / "nope.pem"), "key": str(short_tmp / "nope.key")}
    result = serve_exit(short_tmp, listen=[f"unix://{short_tmp}/d.sock", {"address": "127.0.0.1:0", "tls": tls}])
    assert result.returncode == 2 and "nope.pem" in result.stderr, result


# ------------------------------------------------------------------ rotation


def test_certificates_and_tokens_rotate_without_a_restart(short_tmp: Path, pki: Pki) -> None:
    cert, key = short_tmp / "server.pem", short_tmp / "server.key"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    tokens = write_tokens(short_tmp / "tokens.txt", {"trainer": "old-token-123456"})
    listen = [f"unix://{short_tmp}/d.sock", {"address": "127.0.0.1:0", "tls": {"cert": str(cert), "key": str(key)}}]
    with daemon_with({"listen": listen, "auth": {"token_file": str(tokens)}}, short_tmp) as daemon:
        tls_address = tcp_addresses(daemon.log())["TLS"]
        old_ca = {"ca": str(pki.ca)}
        RemoteDataLoader("squares", batch_size=BATCH, address=tls_address, tls=old_ca, token="old-token-123456")

        # New certificate from another CA, written in place (a renewal): new connections get it.
        other = trustme.CA()
        renewed = other.issue_cert("127.0.0.1")
        new_ca = short_tmp / "new-ca.pem"
        new_ca.write_bytes(other.cert_pem.bytes())
        cert.write_bytes(b"".join(b.bytes() for b in renewed.cert_chain_pems))
        key.write_bytes(renewed.private_key_pem.bytes())
        # New token file (the old token is revoked).
        write_tokens(short_tmp / "tokens.new", {"trainer": "new-token-654321"})
        os.replace(short_tmp / "tokens.new", tokens)

        loader = RemoteDataLoader("squares", batch_size=BATCH, address=tls_address, tls={"ca": str(new_ca)}, token="new-token-654321")
        assert_same_batches(list(loader), torch_epoch(), "after rotation")
        with pytest.raises(AuthenticationError, match="not valid"):
            RemoteDataLoader("squares", batch_size=BATCH, address=daemon.address, token="old-token-123456")
        assert "token file" in daemon.log() and "re-read" in daemon.log()
        assert "certificate files" in daemon.log()


def test_tls_through_a_dns_name_checks_the_certificate_against_the_name(short_tmp: Path) -> None:
    """``dns:///name:port`` dials each record's IP; the certificate names the service, not the IPs."""
    from support.cluster import inject_dns

    ca = trustme.CA()
    named = ca.issue_cert("loaderd.cluster.test")  # no IP in it, as a Service's certificate
    cert, key, ca_file = short_tmp / "s.pem", short_tmp / "s.key", short_tmp / "ca.pem"
    cert.write_bytes(b"".join(b.bytes() for b in named.cert_chain_pems))
    key.write_bytes(named.private_key_pem.bytes())
    ca_file.write_bytes(ca.cert_pem.bytes())
    listen = [f"unix://{short_tmp}/d.sock", {"address": "127.0.0.1:0", "tls": {"cert": str(cert), "key": str(key)}}]
    with daemon_with({"listen": listen}, short_tmp) as daemon:
        port = tcp_addresses(daemon.log())["TLS"].rsplit(":", 1)[1]
        with inject_dns("loaderd.cluster.test", lambda: ["127.0.0.1"]):
            loader = RemoteDataLoader(
                "squares", batch_size=BATCH, address=f"dns:///loaderd.cluster.test:{port}", tls={"ca": str(ca_file)}
            )
            assert_same_batches(list(loader), torch_epoch(), "TLS through a DNS name")
        # The same daemon by its IP: the certificate does not name it.
        error = refused_fast("by IP", address=f"127.0.0.1:{port}", tls={"ca": str(ca_file)})
        assert isinstance(error, AuthenticationError) and "does not name the address" in str(error)


def test_a_socket_group_that_cannot_be_used_is_a_config_error() -> None:
    import grp

    from loaderd.server.config.schema import ConfigError, ListenSpec
    from loaderd.server.security.listeners import prepare

    with pytest.raises(ConfigError, match=r"listen\[0\]\.socket_group: no group named 'no-such-group-x'"):
        prepare((ListenSpec("unix:///tmp/x.sock", socket_group="no-such-group-x"),))
    if os.geteuid() == 0:
        return  # root may give a socket to any group
    foreign = next((g for g in grp.getgrall() if g.gr_gid != os.getegid() and g.gr_gid not in os.getgroups()), None)
    if foreign is not None:
        with pytest.raises(ConfigError, match="not a member"):
            prepare((ListenSpec("unix:///tmp/x.sock", socket_group=foreign.gr_name),))
