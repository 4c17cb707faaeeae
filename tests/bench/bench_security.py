"""Benchmark: what TLS and tokens cost. RemoteDataLoader over gRPC (TCP loopback), plaintext vs TLS, and with a token.

    python tests/bench/bench_security.py [--workers 2] [--rounds 5] [--seconds 2.0] [--quick]

Starts two daemons with the same datasets and pool size: ``open`` (a plaintext
and a TLS listener on 127.0.0.1, no auth) and ``auth`` (a token file; a
plaintext listener on 127.0.0.1 and a unix socket). Certificates are made with
trustme (the test extra). For each workload it measures, interleaved in every
round: gRPC plaintext, gRPC TLS (``open``), gRPC plaintext with a token
(``auth``), and shared memory without and with a token (the unix sockets).
Prints medians and ratios; exits 1 if a loader misbehaved.

The token is checked once per call (a stream opens one call per epoch per
daemon), never per batch, so its cost per batch is what the table shows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_loaders import (
    BATCH_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    Daemon,
    Rates,
    Result,
    fmt,
    interleaved_rounds,
    machine_line,
    measure,
    median,
    print_findings,
    ratio_verdict,
    round_args,
    run_guarded,
    start_daemon,
    wait_serving,
    workload_label,
)

WORKLOADS = [("f32", 256), ("u8", 64), ("tiny", 32)]
# (label, daemon, address attribute, tls, token)
LOADERS = [
    ("grpc plaintext", "open", "tcp_address", False, False),
    ("grpc TLS", "open", "tls_address", True, False),
    ("grpc plaintext + token", "auth", "tcp_address", False, True),
    ("shm", "open", "unix_address", False, False),
    ("shm + token", "auth", "unix_address", False, True),
]
TOKEN = "bench-token-0123456789abcdef"
TLS_TARGET = 0.9
LOADERS_BY_LABEL = {label: (which, attr, tls, token) for label, which, attr, tls, token in LOADERS}


def make_pki(directory: Path) -> dict[str, str]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {
        "ca": ca.cert_pem.bytes(),
        "cert": b"".join(blob.bytes() for blob in server.cert_chain_pems),
        "key": server.private_key_pem.bytes(),
    }
    paths = {}
    for name, data in files.items():
        path = directory / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        paths[name] = str(path)
    return paths


def tls_address(daemon: Daemon) -> str:
    import re

    match = re.search(r"(127\.0\.0\.1:\d+): TLS", daemon.log())
    if match is None:
        raise RuntimeError(f"no TLS listener in the daemon log:\n{daemon.log()}")
    return match.group(1)


def run(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from_start = time.perf_counter()
    findings: list[str] = []
    results = {(name, label): Result() for name, _ in WORKLOADS for label, *_ in LOADERS}
    cpu_per_gb: dict[tuple[str, str], list[float]] = {key: [] for key in results}
    pki_dir = Path(tempfile.mkdtemp(prefix="ldb-pki-", dir="/tmp"))
    state["dirs"].append(pki_dir)
    pki = make_pki(pki_dir)
    tokens = pki_dir / "tokens.txt"
    tokens.write_text(f"bench:{TOKEN}\n")
    tokens.chmod(0o600)

    server_tls = {"cert": pki["cert"], "key": pki["key"]}
    open_daemon = start_daemon(args.workers, extra_listen=({"address": "127.0.0.1:0", "tls": server_tls},))
    state["daemons"].append(open_daemon)
    auth_daemon = start_daemon(args.workers, auth={"token_file": str(tokens)})
    state["daemons"].append(auth_daemon)
    for daemon in (open_daemon, auth_daemon):
        wait_serving(daemon, STARTUP_TIMEOUT_S)
    addresses = {
        "open": {"tcp_address": open_daemon.tcp_address, "unix_address": open_daemon.unix_address, "tls_address": tls_address(open_daemon)},
        "auth": {"tcp_address": auth_daemon.tcp_address, "unix_address": auth_daemon.unix_address},
    }
    print(f"[bench] daemons serving: {addresses}", file=sys.stderr, flush=True)

    from loaderd import RemoteDataLoader

    loaders: dict[tuple[str, str], Any] = {}
    for name, batch_size in WORKLOADS:
        for label, which, attr, use_tls, token in LOADERS:
            address = addresses[which][attr]
            loaders[(name, label)] = RemoteDataLoader(
                name,
                batch_size=batch_size,
                shuffle=True,
                timeout=BATCH_TIMEOUT_S,
                address=address,
                transport="shm" if attr == "unix_address" else "grpc",
                tls={"ca": pki["ca"]} if use_tls else False,
                token=TOKEN if token else "",
            )

    def measure_with_cpu(name: str, label: str, expected: tuple[int, ...], dtype: torch.dtype) -> Rates:
        """``measure``, and the CPU seconds per GB that all processes spent on it."""
        rates = measure(loaders[(name, label)], args.seconds, expected, dtype)
        if rates.gb_s > 0:
            # CPU s per 1,000 batches -> per GB (batches/s / GB/s = batches per GB).
            cpu_per_gb[(name, label)].append(rates.cpu_s_per_k / 1000 * rates.batches_s / rates.gb_s)
        return rates

    interleaved_rounds(args, WORKLOADS, [label for label, *_ in LOADERS], results, measure_with_cpu, findings)
    loaders.clear()
    for daemon in list(state["daemons"]):
        _, problem = daemon.stop()
        state["daemons"].remove(daemon)
        if finding := daemon.finding(problem):
            findings.append(finding)
    print_report(args, results, cpu_per_gb, findings, time.perf_counter() - from_start)
    return 1 if findings else 0


def print_report(
    args: argparse.Namespace,
    results: dict[tuple[str, str], Result],
    cpu_per_gb: dict[tuple[str, str], list[float]],
    findings: list[str],
    wall_s: float,
) -> None:
    p = print
    p("## loaderd security benchmark: TLS and tokens\n")
    p(f"- machine: {machine_line()}")
    p(f"- settings: workers={args.workers}, rounds={args.rounds}, seconds={args.seconds}; loaders interleaved in each round")
    p(f"- wall time: {wall_s:.0f} s\n")
    p("| workload | loader | batches/s | GB/s | ratio | CPU s per GB (all processes) | per-round batches/s |")
    p("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, batch_size in WORKLOADS:
        label_w = workload_label(name, batch_size)
        for label, *_ in LOADERS:
            r = results[(name, label)]
            base_label = "shm" if label.startswith("shm") else "grpc plaintext"
            bps = median(r.batches_s)
            vs = f"{fmt(ratio_verdict(r, results[(name, base_label)], 0)[0], 2)}x vs {base_label}"
            shown = "1.00x" if label == base_label else vs
            rounds = ", ".join(f"{x:.0f}" for x in r.batches_s)
            cpu = fmt(median(cpu_per_gb[(name, label)]), 2) if name != "tiny" else "-"
            p(f"| {label_w} | {label} | {fmt(bps)} | {fmt(median(r.gb_s), 3)} | {shown} | {cpu} | {rounds} |")
    p("")
    p("CPU s per GB: user+system seconds of this client process, the daemon, its fork server and workers,")
    p(f"per GB delivered (machine: {os.cpu_count()} cores; where they are all busy, extra CPU per GB is lost throughput).\n")
    p(f"### Target: TLS >= {TLS_TARGET:g}x plaintext gRPC on large batches\n")
    for name in ("f32", "u8"):
        ratio, verdict = ratio_verdict(results[(name, "grpc TLS")], results[(name, "grpc plaintext")], TLS_TARGET)
        p(f"- {name}: {fmt(ratio, 2)}x, {verdict}")
    p("")
    print_findings(p, findings)


def main() -> int:
    args = round_args(__doc__.split("\n\n")[0], "each daemon's pool size")
    state: dict[str, Any] = {"daemons": [], "dirs": []}

    def cleanup() -> None:
        for daemon in state["daemons"]:
            daemon.stop()
        state["daemons"].clear()
        for directory in state["dirs"]:
            shutil.rmtree(directory, ignore_errors=True)

    budget = 240 + args.rounds * len(WORKLOADS) * len(LOADERS) * (args.seconds + 5)
    return run_guarded(budget, lambda: run(args, state), cleanup)


if __name__ == "__main__":
    sys.exit(main())
