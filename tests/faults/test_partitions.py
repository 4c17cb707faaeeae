"""Partitions, one-way cuts and slow links on real network stacks (issue 41).

Each daemon and client runs on its own host of a ``HostBed`` (tests/support/netns.py): a network
namespace with its own address on one bridge and its own /dev/shm, so a client really streams over
gRPC, and a cut link drops packets silently (no reset), as a partition does. Every epoch is checked
batch by batch against torch's DataLoader, in the client. Skipped (saying why) without root.

The daemons ping every second and wait a second (limits.keepalive_time/keepalive_timeout: they
reclaim a partitioned client within 2 s); the clients keep their own keepalive (10 s + 5 s,
client/fleet/connection.py), so a client notices a partition within 15 s.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator

import pytest
from support.bed_cluster import BedClient, BedCluster, BedDaemon, bed_cluster
from support.daemons import wait_for
from support.netns import host_bed

DATASETS = {
    "squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 400}},
    "blocks": {"dataset": "support.datasets:Blocks", "kwargs": {"n": 240}},
}
KEEPALIVE = {"keepalive_time": 1.0, "keepalive_timeout": 1.0}
DAEMON_NOTICE_S = 2.0
CLIENT_NOTICE_S = 15.0  # client/fleet/connection.py: a ping every 10 s, 5 s for its answer
SLACK_S = 4.0

# Epochs of a shuffled map-style dataset over the daemons named in argv[1], each checked against torch's
# as it arrives. Before each epoch it waits for a line on stdin (the test's go); it prints every batch.
# prefetch_factor 8 (16 batches a lane, every epoch): what a cut-off or slowed daemon holds stays the same in
# every epoch; by default small batches deepen it to 32 from the second epoch (half of blocks' 60-batch epoch).
CLIENT = """
import sys, time, torch
from torch.utils.data import DataLoader
from loaderd import RemoteDataLoader, DaemonUnavailableError
from support import datasets
from support.compare import assert_same
addresses, name, epochs, pause, failover = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
dataset = {"squares": lambda: datasets.Squares(400), "blocks": lambda: datasets.Blocks(240)}[name]()
loader = RemoteDataLoader(name, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), address=addresses,
                          num_workers=2, failover_timeout=failover, prefetch_factor=8)
oracle = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
for epoch in range(epochs):
    sys.stdin.readline()
    want = list(oracle)
    started, n = time.monotonic(), 0
    try:
        for i, batch in enumerate(loader):
            assert_same(batch, want[i], f"epoch {epoch} batch {i}")
            n += 1
            print(f"epoch {epoch} batch {i} {time.monotonic() - started:.3f}", flush=True)
            time.sleep(pause)
    except DaemonUnavailableError as exc:
        print(f"unavailable after {n} batches: {exc}".replace(chr(10), " "), flush=True)
        continue
    print(f"epoch {epoch} {'equal' if n == len(want) else 'short'} {time.monotonic() - started:.3f}", flush=True)
"""


def is_batch(epoch: int, i: int) -> re.Pattern[str]:
    return re.compile(rf"epoch {epoch} batch {i} ")


def epoch_end(client: BedClient, epoch: int, timeout: float) -> list[str]:
    lines = client.read_until(
        lambda line: line.startswith((f"epoch {epoch} equal", f"epoch {epoch} short", "unavailable", "Traceback")), timeout, f"epoch {epoch}'s end"
    )
    assert lines[-1].startswith(f"epoch {epoch} equal"), "".join(lines[-30:])
    return lines


def go(client: BedClient) -> None:
    assert client.process.stdin is not None
    client.process.stdin.write("go\n")
    client.process.stdin.flush()


def streams_sent(daemon: BedDaemon) -> dict[int, int | None]:
    """Each stream the daemon opened -> the batches it sent (None while it has not ended), from its log."""
    log = daemon.log()
    sent: dict[int, int | None] = {int(n): None for n in re.findall(r"stream (\d+) opened", log)}
    for stream, n in re.findall(r"stream (\d+) (?:finished: |of .* ended by the client after )(\d+) batches", log):
        sent[int(stream)] = int(n)
    return sent


def served(daemon: BedDaemon, streams: set[int] | None = None) -> int:
    """Batches the daemon sent on its ended streams (only ``streams``, if given)."""
    return sum(n or 0 for stream, n in streams_sent(daemon).items() if streams is None or stream in streams)


def client_streams(daemon: BedDaemon) -> int:
    return len(daemon.status().streams)


@pytest.fixture
def two_daemons() -> Iterator[BedCluster]:
    with host_bed(["d1", "d2", "c1"]) as bed, bed_cluster(bed, DATASETS, workers=2, limits=KEEPALIVE) as cluster:
        for host in ("d1", "d2"):
            cluster.start(cluster.add_daemon(host))
        yield cluster


@pytest.fixture
def two_daemons_default_keepalive() -> Iterator[BedCluster]:
    """As ``two_daemons``, pinging at the defaults: over a slow link a ping waits behind the data
    queued before it, and a 1 s timeout would cut a connection that is only slow."""
    with host_bed(["d1", "d2", "c1"]) as bed, bed_cluster(bed, DATASETS, workers=2) as cluster:
        for host in ("d1", "d2"):
            cluster.start(cluster.add_daemon(host))
        yield cluster


def start_client(cluster: BedCluster, dataset: str, epochs: int, pause: float, failover: float = 60.0) -> BedClient:
    addresses = ",".join(d.address for d in cluster.daemons.values())
    return cluster.client("c1", CLIENT, addresses, dataset, str(epochs), str(pause), str(failover))


@pytest.mark.timeout(180)
def test_a_daemon_cut_off_both_ways_then_one_way_each_way_loses_nothing_and_rejoins_when_healed(two_daemons: BedCluster) -> None:
    cluster, bed = two_daemons, two_daemons.bed
    d1 = cluster.daemons["d1"]
    client = start_client(cluster, "squares", epochs=5, pause=0.02)
    for epoch, direction in enumerate(("both", "out", "in")):
        go(client)
        client.read_until(is_batch(epoch, 20).match, 60, f"epoch {epoch}'s 20th batch")
        cut_at = time.monotonic()
        bed.cut("d1", direction)
        # The epoch completes exactly once, equal to torch's: what d1 owed goes to d2 (hedged or failed over).
        lines = epoch_end(client, epoch, 60)
        stamps = [float(line.split()[4]) for line in lines if line.startswith(f"epoch {epoch} batch")]
        held = max(b - a for a, b in itertools.pairwise(stamps))
        assert held < CLIENT_NOTICE_S, f"cut {direction}: the epoch stood still {held:.1f} s"
        # d1 lost its client: its streams are reclaimed within its keepalive bound.
        wait_for(
            lambda: client_streams(d1) == 0,
            max(0.0, DAEMON_NOTICE_S + SLACK_S - (time.monotonic() - cut_at)) + 1,
            f"d1 to reclaim the cut ({direction}) client's streams",
        )
        assert bed.dropped("d1") > 0, "the cut dropped nothing: the test did not partition anything"
        bed.heal("d1")
    # Healed, d1 serves again: its share of the next epochs, no batch twice (the client checks each). Two epochs: the
    # client takes d1 back when its fleet monitor next finds it answering, and a short epoch may end before that
    # (a fresh-clone CI run: d1 served nothing of the one epoch after the heal).
    before = served(d1)
    for epoch in (3, 4):
        go(client)
        epoch_end(client, epoch, 60)
    wait_for(lambda: served(d1) > before, 10, "d1 to have served part of the epochs after the heal")
    assert client.process.wait(30) == 0


def stamps_of(lines: list[str], epoch: int) -> list[float]:
    return [float(line.split()[4]) for line in lines if line.startswith(f"epoch {epoch} batch")]


@pytest.mark.timeout(180)
def test_a_slow_link_gets_less_work_and_holds_the_epoch_back_no_more_than_its_window(two_daemons_default_keepalive: BedCluster) -> None:
    cluster, bed = two_daemons_default_keepalive, two_daemons_default_keepalive.bed
    d1, d2 = cluster.daemons["d1"], cluster.daemons["d2"]
    client = start_client(cluster, "blocks", epochs=2, pause=0.02)  # 60 batches of 512 KiB each, a 20 ms step each

    def shares(before: tuple[set[int], set[int]] = (set(), set())) -> tuple[tuple[int, int], tuple[set[int], set[int]]]:
        """Batches each daemon sent on the streams it opened since ``before`` (a hedged position counts on both)."""
        wait_for(lambda: None not in [*streams_sent(d1).values(), *streams_sent(d2).values()], 10, "the epoch's streams to end")
        opened = set(streams_sent(d1)), set(streams_sent(d2))
        return (served(d1, opened[0] - before[0]), served(d2, opened[1] - before[1])), opened

    go(client)
    fast = float(epoch_end(client, 0, 60)[-1].split()[-1])
    share_fast, seen = shares()
    bed.slow("d1", "8mbit")  # a batch takes ~0.5 s over d1's link
    go(client)
    slow = float(epoch_end(client, 1, 120)[-1].split()[-1])
    share_slow, _ = shares(seen)
    print(
        f"epoch over two fast links {fast:.2f} s (d1 {share_fast[0]}, d2 {share_fast[1]} batches); "
        f"d1 slowed: {slow:.2f} s (d1 {share_slow[0]}, d2 {share_slow[1]})"
    )
    assert share_slow[0] < sum(share_slow) / 4, f"the slow daemon still sent {share_slow[0]} of {sum(share_slow)} batches"
    assert slow <= fast + 2.0, f"the slow link held the epoch back: {slow:.1f} s against {fast:.1f} s"
    assert client.process.wait(30) == 0


@pytest.mark.timeout(180)
def test_a_client_cut_off_from_every_daemon_carries_on_if_healed_in_time_and_else_fails_after_failover_timeout(
    two_daemons: BedCluster,
) -> None:
    cluster, bed = two_daemons, two_daemons.bed
    failover = 4.0
    client = start_client(cluster, "squares", epochs=2, pause=0.02, failover=failover)
    go(client)
    client.read_until(is_batch(0, 20).match, 60, "epoch 0's 20th batch")
    bed.cut("c1")
    cut_at = time.monotonic()
    # Both daemons reclaim the vanished client's streams within their keepalive bound.
    for daemon in cluster.daemons.values():
        wait_for(lambda daemon=daemon: client_streams(daemon) == 0, DAEMON_NOTICE_S + SLACK_S, f"{daemon.host} to reclaim the client's streams")
    reclaimed_s = time.monotonic() - cut_at
    time.sleep(max(0.0, failover - 1.0 - reclaimed_s))
    bed.heal("c1")  # before the client's failover_timeout: it carries on at the exact next batch
    lines = epoch_end(client, 0, 60)
    print(f"reclaimed in {reclaimed_s:.1f} s; the epoch stood still {max(b - a for a, b in itertools.pairwise(stamps_of(lines, 0))):.1f} s")
    go(client)
    client.read_until(is_batch(1, 20).match, 60, "epoch 1's 20th batch")
    bed.cut("c1")
    cut_at = time.monotonic()
    lines = client.read_until(
        lambda line: line.startswith(("unavailable", "epoch 1 equal", "Traceback")),
        CLIENT_NOTICE_S + failover + SLACK_S + 5,
        "DaemonUnavailableError",
    )
    failed_s = time.monotonic() - cut_at
    assert lines[-1].startswith("unavailable"), "".join(lines[-20:])
    assert failover <= failed_s <= CLIENT_NOTICE_S + failover + SLACK_S, f"DaemonUnavailableError {failed_s:.1f} s after the cut"
    print(f"DaemonUnavailableError {failed_s:.1f} s after the cut: {lines[-1][:300]}")
    assert client.process.wait(30) == 0
