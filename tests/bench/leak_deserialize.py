#!/usr/bin/env python
"""Does a sync grpc.server leak memory on requests its deserializer rejects?

Starts a bare ``grpc.server`` in a subprocess (so the RSS read from
/proc/<pid>/status is the server's alone), sends it N garbage requests
(seeded random bytes that ``FromString`` rejects) per method, and prints the
server's RSS growth in KiB per request. Modes:

  proto         request_deserializer=Msg.FromString: grpc parses, the handler
                never sees garbage (grpc answers INTERNAL itself)
  identity      request_deserializer=None: the handler gets bytes, parses them
                and answers INVALID_ARGUMENT via context.abort on DecodeError
  raise         request_deserializer=None, the handler's parse error escapes
                (UNKNOWN): an uncaught handler exception, for comparison
  health        the stock HealthServicer + v1alpha reflection, as grpc ships them
  health-fixed  the same servicers, their handlers rewrapped by loaderd.server.rpc.handlers.add_parsing

Every mode also serves /leak.Ctl/Snapshot (identity), which runs gc and
answers RSS, live grpc._server._RPCState objects and, with --trace, how many
server batches grpc started and what grpc_call_error each returned (0 = OK;
8 = GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: a second status on one call).
The "stop" column says whether server.stop(0.5) completed within 3 s after the
traffic ("HUNG": leaked calls keep the server from ever finishing its shutdown).

  python tests/bench/leak_deserialize.py                    # all modes, N=20000
  python tests/bench/leak_deserialize.py -n 2000 --modes proto,identity --trace
  python tests/bench/leak_deserialize.py -n 500 --modes identity,health-fixed --check 4  # exit 1 on > 4 KiB/req
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from loaderd.server.rpc.handlers import add_parsing

Msg = health_pb2.HealthCheckRequest  # any message will do: the leak is in grpc/_server.py, not in protobuf
MODES = ("proto", "identity", "raise", "health", "health-fixed")
KINDS = {  # mode -> [(kind, method path, arity, message class the garbage must not parse as)]
    "echo": [("unary", "/leak.Echo/U", "uu", Msg), ("stream", "/leak.Echo/S", "ss", Msg)],
    "health": [
        ("health.Check", "/grpc.health.v1.Health/Check", "uu", health_pb2.HealthCheckRequest),
        ("health.Watch", "/grpc.health.v1.Health/Watch", "us", health_pb2.HealthCheckRequest),
        ("reflection", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "ss",
         reflection_pb2.ServerReflectionRequest),
    ],
}


# --- the fix: parse inside the handler ---------------------------------------------------


def parse_or_abort(parse: Callable[[bytes], Any], raw: bytes, context: grpc.ServicerContext) -> Any:
    """``parse(raw)``, or end the call with INVALID_ARGUMENT (context.abort raises)."""
    try:
        return parse(raw)
    except DecodeError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse request: {exc}")


# --- server (subprocess) ----------------------------------------------------------------


def rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


BATCHES: Counter[int] = Counter()


def install_trace() -> None:
    """Count the grpc_call_error of every server batch _abort and _status start (diagnosis only)."""
    from grpc import _server

    class CallProxy:
        def __init__(self, call: Any) -> None:
            self._call = call

        def start_server_batch(self, operations: Any, tag: Any) -> Any:
            error = self._call.start_server_batch(operations, tag)
            BATCHES[int(error)] += 1
            return error

        def __getattr__(self, name: str) -> Any:
            return getattr(self._call, name)

    class EventProxy:
        def __init__(self, event: Any) -> None:
            self._event, self.call = event, CallProxy(event.call)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._event, name)

    abort, status = _server._abort, _server._status
    _server._abort = lambda state, call, code, details: abort(state, CallProxy(call), code, details)
    _server._status = lambda event, state, response: status(EventProxy(event), state, response)


def snapshot(request: bytes, context: grpc.ServicerContext) -> bytes:
    from grpc import _server

    for _ in range(3):
        gc.collect()
    states = sum(1 for o in gc.get_objects() if type(o) is _server._RPCState)
    return json.dumps({"rss_kib": rss_kib(), "rpc_states": states, "batches": dict(BATCHES)}).encode()


def echo_handlers(mode: str) -> grpc.GenericRpcHandler:
    def parse(raw: bytes, context: grpc.ServicerContext) -> Any:
        return Msg.FromString(raw) if mode == "raise" else parse_or_abort(Msg.FromString, raw, context)

    def unary(request: Any, context: grpc.ServicerContext) -> bytes:
        if mode != "proto":
            parse(request, context)
        return b"ok"

    def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[bytes]:
        for request in requests:
            if mode != "proto":
                parse(request, context)
            yield b"ok"

    deserializer = Msg.FromString if mode == "proto" else None
    return grpc.method_handlers_generic_handler(
        "leak.Echo",
        {
            "U": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserializer),
            "S": grpc.stream_stream_rpc_method_handler(stream, request_deserializer=deserializer),
        },
    )


def serve(mode: str, trace: bool) -> None:
    if trace:
        install_trace()
    # grpc logs a traceback per rejected request (grpc._common) or failed handler (grpc._server).
    for name in ("grpc._common", "grpc._server"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    ctl = {"Snapshot": grpc.unary_unary_rpc_method_handler(snapshot)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("leak.Ctl", ctl),))
    if mode == "health":
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    elif mode == "health-fixed":
        add_parsing(health_pb2_grpc.add_HealthServicer_to_server, health.HealthServicer(), server)
        servicer = reflection.ReflectionServicer((health.SERVICE_NAME, reflection.SERVICE_NAME))
        add_parsing(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, servicer, server)
    else:
        server.add_generic_rpc_handlers((echo_handlers(mode),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    # A leaked call can keep the server from ever finishing its shutdown: stop(None) would block
    # forever, so give a grace and a bounded wait, and report whether the shutdown completed.
    stopped = server.stop(0.5).wait(3.0)
    print(f"STOPPED {stopped}", flush=True)
    os._exit(0)


# --- client -----------------------------------------------------------------------------


def garbage(rng: random.Random, message: Any, n: int) -> list[bytes]:
    """``n`` random byte strings (16..256 bytes) that ``message.FromString`` rejects."""
    out: list[bytes] = []
    while len(out) < n:
        raw = rng.randbytes(rng.randint(16, 256))
        try:
            message.FromString(raw)
        except DecodeError:
            out.append(raw)
    return out


def send(channel: grpc.Channel, path: str, arity: str, requests: list[bytes], pool: futures.Executor) -> Counter[str]:
    """Send each request as its own call; the status codes seen."""
    if arity == "uu":
        method = channel.unary_unary(path)
        one = lambda raw: method(raw, timeout=10)  # noqa: E731 - a one-line probe, read where it is used
    elif arity == "us":
        method = channel.unary_stream(path)
        one = lambda raw: list(method(raw, timeout=10))  # noqa: E731 - a one-line probe, read where it is used
    else:
        method = channel.stream_stream(path)
        one = lambda raw: list(method(iter([raw]), timeout=10))  # noqa: E731 - a one-line probe, read where it is used

    def call(raw: bytes) -> str:
        try:
            one(raw)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    return Counter(pool.map(call, requests))


def measure(mode: str, n: int, warmup: int, concurrency: int, seed: int, trace: bool) -> list[dict[str, Any]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", mode] + (["--trace"] if trace else [])
    env = {**os.environ, "GRPC_VERBOSITY": os.environ.get("GRPC_VERBOSITY", "ERROR")}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    rows: list[dict[str, Any]] = []
    stopped = False
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"server did not start: {line!r}")
        with grpc.insecure_channel(f"127.0.0.1:{line.split()[1]}") as channel, futures.ThreadPoolExecutor(
            concurrency
        ) as pool:
            snap = lambda: json.loads(channel.unary_unary("/leak.Ctl/Snapshot")(b"", timeout=60))  # noqa: E731 - a one-line probe, read where it is used
            kinds = KINDS["health" if mode.startswith("health") else "echo"]
            rng = random.Random(seed)
            for _, path, arity, message in kinds:  # warm up: threads, arenas, caches
                send(channel, path, arity, garbage(rng, message, warmup), pool)
            before = snap()
            for kind, path, arity, message in kinds:
                requests = garbage(rng, message, n)
                began = time.monotonic()
                codes = send(channel, path, arity, requests, pool)
                seconds = time.monotonic() - began
                after = snap()
                rows.append(
                    {
                        "mode": mode,
                        "kind": kind,
                        "n": n,
                        "codes": dict(codes),
                        "kib_per_req": (after["rss_kib"] - before["rss_kib"]) / n,
                        "rss_mib": after["rss_kib"] / 1024,
                        "rpc_states": after["rpc_states"],
                        "batches": after["batches"],
                        "seconds": seconds,
                    }
                )
                before = after
    finally:
        proc.stdin.close()
        try:
            stopped = proc.stdout.read().strip() == "STOPPED True"
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for row in rows:
        row["stopped"] = stopped
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20000, help="garbage requests per method (default 20000)")
    ap.add_argument("--warmup", type=int, default=1000, help="garbage requests per method before the first RSS")
    ap.add_argument("--concurrency", type=int, default=8, help="client calls in flight")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--trace", action="store_true", help="count server batches by grpc_call_error")
    ap.add_argument("--check", type=float, metavar="KIB", help="exit 1 if any method grows > KIB per request")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.trace)
        return 0
    print(f"grpcio {grpc.__version__}, python {sys.version.split()[0]}, n={args.n}, warmup={args.warmup}")
    print(f"{'mode':<13} {'method':<13} {'KiB/req':>8} {'RSS MiB':>8} {'_RPCState':>9} {'req/s':>6} {'stop':>5}  codes")
    failed = False
    for mode in args.modes.split(","):
        for row in measure(mode, args.n, args.warmup, args.concurrency, args.seed, args.trace):
            batches = f"  batches {row['batches']}" if args.trace else ""
            print(
                f"{row['mode']:<13} {row['kind']:<13} {row['kib_per_req']:>8.2f} {row['rss_mib']:>8.1f} "
                f"{row['rpc_states']:>9} {row['n'] / row['seconds']:>6.0f} {'ok' if row['stopped'] else 'HUNG':>5}"
                f"  {row['codes']}{batches}",
                flush=True,
            )
            if args.check is not None and row["kib_per_req"] > args.check:
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
