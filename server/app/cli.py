"""The ``loaderd`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import grpc

from loaderd.channel.credentials import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_ENV, Credentials, open_channel, refusal
from loaderd.channel.rpc_errors import NO_DAEMON_HINT, explain_unreachable
from loaderd.errors import LoaderdError
from loaderd.server.app.daemon import Daemon
from loaderd.server.app.signals import StopSignals
from loaderd.server.config.schema import ConfigError, ListenSpec, LoaderConfig, MetricsConfig, check_listen, check_port, load_config
from loaderd.server.ops.notify import SystemdNotifier, start_watchdog_pings
from loaderd.server.ops.status import ClientKey, ClientRate, client_rates, format_status, status_json
from loaderd.server.pool.fork_server import PoolStartError
from loaderd.server.process import stack_dumps
from loaderd.server.process.host_cpu import usable_cpus
from loaderd.server.process.log_format import LOG_FORMATS, configure_logging
from loaderd.server.security.listeners import ListenError
from loaderd.server.worker.user_code import check_imports
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.v1 import loaderd_pb2_grpc as pb_grpc
from loaderd.wire.addresses import DEFAULT_ADDRESS, single_address

EXIT_CONFIG = 2
EXIT_START = 1
EXIT_FAILED = 1  # the daemon ran, then could no longer serve (see its log)
EXIT_UNREACHABLE = 1  # `loaderd status`: no daemon answered


def _fatal(config: LoaderConfig, line: str) -> None:
    """The one line the daemon ends with: plain on stderr, or a JSON record where the log is JSON."""
    if config.log_format == "json":
        logging.getLogger("loaderd").critical(line.removeprefix("loaderd: "))
    else:
        print(line, file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        overrides: dict[str, Any] = {}
        if args.listen:
            overrides["listen"] = tuple(ListenSpec(address) for address in args.listen)
            check_listen(overrides["listen"])
        if args.workers is not None:
            if args.workers < 1:
                raise ConfigError(f"--workers: must be at least 1, got {args.workers}")
            overrides.update(workers=args.workers, min_workers=None)  # a fixed pool, whatever the config said
        if args.metrics_port is not None:
            port = check_port(args.metrics_port, "--metrics-port")
            overrides["metrics"] = dataclasses.replace(config.metrics or MetricsConfig(), port=port)
        config = dataclasses.replace(config, **overrides)
    except ConfigError as exc:
        print(f"loaderd: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    # The flags replace the config's values, so the pool's processes (which read the config) log alike.
    config = dataclasses.replace(config, log_level=args.log_level or config.log_level, log_format=args.log_format or config.log_format)
    configure_logging(config.log_level, config.log_format)
    stack_dumps.install()  # `kill -USR1`: every thread's stack in the log (for a daemon that stops answering)
    # SIGTERM drains first (clients move away), then stops; SIGINT, or a second SIGTERM, stops at once.
    signals = StopSignals()
    signals.install()
    try:
        return _run_daemon(config, args.startup_timeout, signals)
    finally:
        signals.close()


def _run_daemon(config: LoaderConfig, startup_timeout: float, signals: StopSignals) -> int:
    """Start the daemon, serve until a signal or a failure, stop; the exit code."""
    notifier = SystemdNotifier.from_env()  # a no-op unless systemd runs us (Type=notify)
    daemon = Daemon(config, startup_timeout=startup_timeout)
    try:
        daemon.start()
    except ConfigError as exc:
        daemon.shutdown()
        _fatal(config, f"loaderd: config error: {exc}")
        return EXIT_CONFIG
    except (PoolStartError, ListenError) as exc:
        daemon.shutdown()
        _fatal(config, f"loaderd: cannot start: {exc}")
        return EXIT_START
    signals.start()  # only now: the daemon forked what it forks before the process has threads
    notifier.ready(f"serving on {', '.join(daemon.bound)}")
    pings_done = threading.Event()
    start_watchdog_pings(notifier, healthy=lambda: not daemon.failed.is_set(), done=pings_done)
    try:
        while not (signals.woken.wait(0.5) or daemon.failed.is_set()):
            pass
        if daemon.failed.is_set():
            notifier.status(f"failed: {daemon.fatal}")  # no STOPPING=1: exiting 1 lets Restart=on-failure act
        elif signals.drain.is_set() and not signals.stop.is_set():
            notifier.stopping("draining: clients are moving to other daemons")
            daemon.drain(config.drain_timeout, abort=signals.stop)
            notifier.status("stopping")
        else:
            notifier.stopping("stopping")
    finally:
        daemon.shutdown()
        pings_done.set()
        notifier.close()
    if daemon.failed.is_set():
        _fatal(config, f"loaderd: stopped: {daemon.fatal}")
        return EXIT_FAILED
    return 0


def _load_imported(path: str) -> LoaderConfig | None:
    """The config at ``path`` with every callable it names imported, as serve checks first; None (said in
    serve's one line) if it cannot be used."""
    try:
        config = load_config(path)
        check_imports(config)
    except ConfigError as exc:
        print(f"loaderd: config error: {exc}", file=sys.stderr)
        return None
    return config


def _check(args: argparse.Namespace) -> int:
    from loaderd.server.app.check import check_config, format_report  # torch: not for the other commands (serve)

    config = _load_imported(args.config)
    if config is None:
        return EXIT_CONFIG
    if args.batch_size < 1:
        print(f"loaderd: --batch-size must be at least 1, got {args.batch_size}", file=sys.stderr)
        return EXIT_CONFIG
    if not args.json:
        listen = ", ".join(config.addresses)
        print(f"{args.config}: valid; {len(config.datasets)} dataset(s), workers: {config.workers_words}, listen: {listen}\n", flush=True)
    reports = []
    for report in check_config(config, args.batch_size, args.timeout, every_item=args.all):
        reports.append(report)
        if not args.json:
            print(format_report(report), flush=True)
    failed = [r for r in reports if r.error]
    if args.json:
        print(json.dumps({"config": str(args.config), "datasets": [dataclasses.asdict(r) for r in reports]}, indent=2))
    if failed:  # each cause once (above, or in the JSON); stderr has the verdict a script greps for
        names = ", ".join(r.name for r in failed)
        where = "in the JSON" if args.json else "above"
        print(f"loaderd: check failed for {len(failed)} of {len(reports)} dataset(s) ({names}); the causes are {where}", file=sys.stderr)
    elif not args.json and args.all:
        print(f"\nOK: every dataset builds, yields every item and collates ({len(reports)})")
    elif not args.json:
        print(f"\nOK: every dataset builds, yields the items sampled and collates ({len(reports)}); --all fetches every item")
    return EXIT_START if failed else 0


def _bench(args: argparse.Namespace) -> int:
    from loaderd.server.app.bench import BenchError, BenchOptions, run_bench  # torch: not for the other commands (serve)

    config = _load_imported(args.config)
    if config is None:
        return EXIT_CONFIG
    # An elastic pool's size varies: torch's DataLoader gets what a CPU-bound pool settles at, the CPUs it may use.
    fixed = config.workers if config.min_workers is None else min(config.workers, usable_cpus())
    num_workers = fixed if args.num_workers is None else args.num_workers
    if min(args.batch_size, args.epochs) < 1 or num_workers < 0 or args.max_batches < 0:
        print("loaderd: --batch-size and --epochs must be >= 1, --num-workers and --max-batches >= 0", file=sys.stderr)
        return EXIT_CONFIG
    options = BenchOptions(
        config=config,
        dataset=args.dataset,
        batch_size=args.batch_size,
        num_workers=num_workers,
        epochs=args.epochs,
        max_batches=args.max_batches,
        shuffle=not args.no_shuffle,
        address=args.address or "",
    )
    try:
        run_bench(options, sys.stdout, sys.stderr)
    except BenchError as exc:
        print(f"loaderd: {exc}", file=sys.stderr)
        return EXIT_START
    except KeyboardInterrupt:
        return EXIT_START
    return 0


def _tls_flags(args: argparse.Namespace) -> dict[str, str] | None:
    """The TLS files from --tls-* flags, each falling back to its variable; None (the variables alone) without flags."""
    flags = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    if not any(flags.values()):
        return None
    env = {"ca": TLS_CA_ENV, "cert": TLS_CERT_ENV, "key": TLS_KEY_ENV}
    return {k: v or os.environ.get(env[k], "") for k, v in flags.items()}


def _status(args: argparse.Namespace) -> int:
    if not args.interval > 0 or args.count < 0:
        print(f"loaderd: --interval must be > 0 and --count >= 0 (got {args.interval:g}, {args.count})", file=sys.stderr)
        return EXIT_CONFIG
    try:
        address = single_address(args.address)
    except LoaderdError as exc:
        print(f"loaderd: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        credentials = Credentials.resolve(_tls_flags(args), args.token)
    except LoaderdError as exc:
        print(f"loaderd: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    # --watch: gRPC's reconnect backoff (up to 2 minutes) would hide a restarted daemon; retry each interval.
    backoff_ms = max(100, int(args.interval * 1000))
    backoff = ("grpc.initial_reconnect_backoff_ms", "grpc.min_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms")
    options: list[tuple[str, Any]] = [(name, backoff_ms) for name in backoff] if args.watch else []
    with open_channel(address, credentials, options) as channel:
        stub = pb_grpc.LoaderStub(channel)
        previous: tuple[pb.StatusResponse, float] | None = None
        shown = 0
        said = ""  # --watch: the failure last printed, said once until another (or a reply) comes
        try:
            while True:
                try:
                    reply = stub.Status(pb.StatusRequest(), timeout=args.timeout)
                except grpc.RpcError as exc:
                    failure = _status_failure(exc, address, credentials)
                    if failure != said:
                        retrying = f" (retrying every {args.interval:g}s)" if args.watch else ""
                        print(f"loaderd: cannot get status from {address}: {failure}{retrying}", file=sys.stderr, flush=True)
                        said = failure
                    if not args.watch or exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        return EXIT_UNREACHABLE
                    previous = None  # a restarted daemon counts anew
                    time.sleep(args.interval)
                    continue
                said = ""
                now = time.monotonic()
                rates = client_rates(previous[0] if previous else None, reply, now - previous[1] if previous else 0.0)
                _show_status(args, reply, rates)
                shown += 1
                if not args.watch or shown == args.count:
                    return 0
                previous = (reply, now)
                time.sleep(args.interval)
        except KeyboardInterrupt:  # the way out of --watch
            return 0


def _status_failure(exc: grpc.RpcError, address: str, credentials: Credentials) -> str:
    """A failed Status call in one line, in a user's words."""
    detail = " ".join((exc.details() or "").split())  # one line, whatever gRPC put in it
    refused = refusal(exc, address, credentials)  # a TLS mismatch, which gRPC reports as a closed socket
    if refused is not None:
        detail = str(refused)
    elif exc.code() == grpc.StatusCode.UNAVAILABLE:
        detail = f"{explain_unreachable(exc, address)}. {NO_DAEMON_HINT}"
    return f"{exc.code().name}: {detail}"


def _show_status(args: argparse.Namespace, reply: pb.StatusResponse, rates: dict[ClientKey, ClientRate]) -> None:
    """One status snapshot: tables (``--watch`` on a terminal: redrawn in place), or JSON (one line per snapshot with ``--watch``)."""
    if args.json:
        print(json.dumps(status_json(reply, rates), indent=None if args.watch else 2), flush=True)
        return
    text = format_status(reply, rates)
    if args.watch and sys.stdout.isatty():
        # Home and clear, then the tables: a refreshing view without a terminal library.
        text = f"\x1b[H\x1b[2J{time.strftime('%H:%M:%S')}  every {args.interval:g}s (rates over the last interval); Ctrl-C to stop\n\n{text}"
    print(text + ("\n" if args.watch else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loaderd", description="A data-loading daemon for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    serve.add_argument("--listen", action="append", help="address to serve (repeatable); replaces the config's listen")
    serve.add_argument("--workers", type=int, help="a fixed pool of this many workers; replaces the config's workers")
    serve.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--log-format", choices=list(LOG_FORMATS), help="replaces the config's log_format (text or json)")
    serve.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds, from the start, for the config's imports and for the workers to build the datasets; "
        "later, for each replacement worker to build them",
    )
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    check = sub.add_parser("check", help="validate a config and build, sample and collate each dataset here")
    check.add_argument("--config", required=True, help="path to the YAML config")
    check.add_argument("--batch-size", type=int, default=8, help="items per collated batch (default 8)")
    check.add_argument("--json", action="store_true", help="print the reports as JSON")
    check.add_argument("--timeout", type=float, default=300.0, help="seconds each dataset may take (default 300)")
    check.add_argument(
        "--all", action="store_true", help="fetch every item (not a sample) and list every one that fails; mind --timeout"
    )
    bench = sub.add_parser("bench", help="compare torch's DataLoader and RemoteDataLoader on a dataset of a config")
    bench.add_argument("--config", required=True, help="the YAML config that defines the dataset")
    bench.add_argument("--dataset", required=True, help="the dataset's name in the config")
    bench.add_argument("--batch-size", type=int, default=32)
    bench.add_argument(
        "--num-workers", type=int, help="torch's num_workers, and the private daemon's pool size (default: the config's workers)"
    )
    bench.add_argument("--epochs", type=int, default=3, help="rounds: one epoch of each loader per round, interleaved")
    bench.add_argument("--max-batches", type=int, default=0, help="stop each epoch after this many batches (0: whole epochs)")
    bench.add_argument("--no-shuffle", action="store_true", help="sequential order (default: shuffle map-style datasets)")
    bench.add_argument("--address", help="a running daemon that serves the dataset (default: start a private one)")
    status = sub.add_parser("status", help="show a running daemon's pool, datasets, streams and shares")
    status.add_argument("--address", help=f"the daemon (unix:///path or host:port); default: $LOADERD_ADDRESS, else {DEFAULT_ADDRESS}")
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON (with --watch: one line per snapshot)")
    status.add_argument("--watch", action="store_true", help="refresh every --interval seconds, rates over each interval")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between snapshots with --watch (default 2)")
    status.add_argument("--count", type=int, default=0, help="with --watch: stop after this many snapshots (0: until Ctrl-C)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon's reply")
    status.add_argument("--tls-ca", help=f"CA of the daemon's TLS certificate (default: ${TLS_CA_ENV})")
    status.add_argument("--tls-cert", help=f"client certificate for mTLS (default: ${TLS_CERT_ENV})")
    status.add_argument("--tls-key", help=f"its key (default: ${TLS_KEY_ENV})")
    status.add_argument("--token", help=f"bearer token (default: ${TOKEN_ENV}; prefer the variable: arguments show in ps)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "check":
        return _check(args)
    if args.command == "bench":
        return _bench(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
