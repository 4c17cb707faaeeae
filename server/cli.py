"""The ``loaderd`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from types import FrameType

from loaderd.server.config import ConfigError, load_config
from loaderd.server.daemon import Daemon, ListenError
from loaderd.server.pool import PoolStartError

EXIT_CONFIG = 2
EXIT_START = 1


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        overrides = {}
        if args.listen:
            overrides["listen"] = tuple(args.listen)
        if args.workers is not None:
            if args.workers < 1:
                raise ConfigError(f"--workers: must be at least 1, got {args.workers}")
            overrides["workers"] = args.workers
        config = dataclasses.replace(config, **overrides)
    except ConfigError as exc:
        print(f"loaderd: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    logging.basicConfig(
        level=args.log_level or config.log_level,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("loaderd").info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    daemon = Daemon(config, startup_timeout=args.startup_timeout)
    try:
        daemon.start()
    except ConfigError as exc:
        daemon.shutdown()
        print(f"loaderd: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (PoolStartError, ListenError) as exc:
        daemon.shutdown()
        print(f"loaderd: cannot start: {exc}", file=sys.stderr)
        return EXIT_START
    try:
        while not stop.wait(0.5):
            pass
    finally:
        daemon.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loaderd", description="A data-loading daemon for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    serve.add_argument("--listen", action="append", help="address to serve (repeatable); replaces the config's listen")
    serve.add_argument("--workers", type=int, help="pool size; replaces the config's workers")
    serve.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for workers to build datasets")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
