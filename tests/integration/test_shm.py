"""The shared-memory transport, end to end against real daemons.

Workers collate batches into reusable segments in /dev/shm; a client that
proved it shares the daemon's /dev/shm (the session's probe) gets slot handles
and maps them, so its tensors are zero-copy views of a worker's segment. These
tests check what a user relies on:

* a batch the user keeps never changes, however long it is kept and however
  full the arena gets (a full arena degrades to copies over gRPC, never blocks);
* leases come back when batches are dropped, when a client is SIGKILLed, and
  the daemon cleans /dev/shm at shutdown (SIGTERM) and after a SIGKILL (sweep);
* the transport choice: refused when the daemon serves no shared memory,
  verified by the probe over TCP, pinned memory, file modes, mixed batch sizes.

Whether a batch came through shared memory is read from /proc/self/maps: its
tensors' data must lie in a mapping of one of the daemon's /dev/shm segments
(a gRPC batch is copied into ordinary process memory).

Every batch is compared with what torch's own DataLoader yields over the same
dataset built locally (same arguments, same generator seed).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import glob
import importlib.util
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from support import datasets
from support.compare import assert_same, assert_same_batches
from support.daemons import TESTS_DIR, RunningDaemon, client_process, daemon_status, running_daemon, tensors_of, wait_for
from support.processes import cmdline, descendants, pid_alive
from torch.utils.data import DataLoader

import loaderd
import loaderd.shm.session
import loaderd.stream.lane
from loaderd import RemoteDataLoader
from loaderd.epoch.window import MAP_PREFETCH
from loaderd.server.shm import arena as loaderd_arena
from loaderd.shm.leases import Leases, Tick
from loaderd.shm.session import ShmSession
from loaderd.wire.direct_frames import DIRECT_SOCKET_SUFFIX

SHM_DIR = "/dev/shm"
MiB = 1 << 20

# Items whose values all differ (arange + 3 * index), so a batch that changed
# under the user cannot go unnoticed. Written to a temp dir at run time and put
# on the daemon's python_path; the oracle loads the same file.
RAMP_SOURCE = '''
import math

import torch
from torch.utils.data import Dataset


class Ramp(Dataset):
    """Item i is (float32 tensor of `shape` holding arange + 3 * i, i)."""

    def __init__(self, shape, n=128):
        self.n = n
        self.base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"Ramp index {i} out of range for {self.n} items")
        return self.base + 3 * i, i
'''

BIG_SHAPE = [3, 64, 64]  # 48 KiB per item: a batch of 32 is 1.5 MiB (a segment over 1 MiB)
BIG_BATCH = 32
BIG_N = 256  # 8 batches per epoch
MID_SHAPE = [64, 64]  # 16 KiB per item: a batch of 8 is 128 KiB (a 1 MiB segment)
MID_BATCH = 8
MID_N = 200  # 25 batches per epoch
SQUARES_N = 200
# Smaller payloads travel inline (pipe and gRPC), never through a slot.
INLINE_BYTES = getattr(loaderd_arena, "INLINE_BYTES", 0)

# Set by the `ramp` fixture: the temp dir holding shm_ramp.py, and that module loaded here (the oracle).
RAMP_DIR = Path()
PYTHON_PATH: list[str] = []
shm_ramp: Any = None


@pytest.fixture(scope="module", autouse=True)
def ramp() -> Iterator[None]:
    """Write shm_ramp.py where this module's daemons import it from."""
    global RAMP_DIR, PYTHON_PATH, shm_ramp
    assert MID_BATCH * 64 * 64 * 4 >= INLINE_BYTES, "MID batches are small enough to travel inline, not in a slot"
    RAMP_DIR = Path(tempfile.mkdtemp(prefix="ld-shm-ds-", dir="/tmp"))
    (RAMP_DIR / "shm_ramp.py").write_text(RAMP_SOURCE)
    spec = importlib.util.spec_from_file_location("shm_ramp", RAMP_DIR / "shm_ramp.py")
    assert spec is not None and spec.loader is not None
    shm_ramp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shm_ramp)
    PYTHON_PATH = [str(TESTS_DIR), str(RAMP_DIR)]
    yield
    shutil.rmtree(RAMP_DIR, ignore_errors=True)


def ramp_cfg(shape: list[int], n: int) -> dict[str, Any]:
    return {"dataset": "shm_ramp:Ramp", "kwargs": {"shape": shape, "n": n}}


SQUARES_CFG = {"dataset": "support.datasets:Squares", "kwargs": {"n": SQUARES_N}}


# ------------------------------------------------------------------ helpers


def torch_epochs(dataset: Any, epochs: int, **kw: Any) -> list[list[Any]]:
    """What torch's DataLoader yields over ``epochs`` epochs (the oracle)."""
    loader = DataLoader(dataset, **kw)
    return [list(loader) for _ in range(epochs)]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shuffled(
    address: str,
    name: str,
    dataset: Any,
    batch_size: int,
    seed: int,
    epochs: int,
    transport: str = "shm",
    **remote_only: Any,
) -> tuple[RemoteDataLoader, list[list[Any]]]:
    """A shuffling RemoteDataLoader, and what torch's DataLoader yields over ``epochs`` epochs with the same seed."""
    kw: dict[str, Any] = dict(batch_size=batch_size, shuffle=True)
    loader = RemoteDataLoader(name, address=address, transport=transport, generator=seeded(seed), **kw, **remote_only)
    return loader, torch_epochs(dataset, epochs, generator=seeded(seed), **kw)


def segment_prefix(pid: int) -> str:
    return f"loaderd-{pid}-"


def shm_entries(pid: int) -> list[str]:
    """The daemon's entries in /dev/shm (segments and probe files)."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, segment_prefix(pid) + "*")))


_SEGMENT_RE = re.compile(r"-w(\d+)g(\d+)-\d+$")


def segment_sizes(pid: int) -> dict[str, int]:
    """name -> size of the daemon's segments (probe files left out)."""
    sizes = {}
    for name in shm_entries(pid):
        if _SEGMENT_RE.search(name):
            try:
                sizes[name] = os.stat(os.path.join(SHM_DIR, name)).st_size
            except FileNotFoundError:  # evicted meanwhile
                pass
    return sizes


def bytes_per_worker(pid: int) -> dict[str, int]:
    """worker generation ("w0g0") -> bytes of /dev/shm its segments take."""
    totals: dict[str, int] = {}
    for name, size in segment_sizes(pid).items():
        m = _SEGMENT_RE.search(name)
        assert m is not None
        key = f"w{m.group(1)}g{m.group(2)}"
        totals[key] = totals.get(key, 0) + size
    return totals


class Mappings:
    """A snapshot of /proc/self/maps: which file backs an address."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, str]] = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                self.rows.append((lo, hi, parts[5].strip() if len(parts) > 5 else ""))
        self.rows.sort()
        self.starts = [lo for lo, _, _ in self.rows]

    def file_of(self, address: int) -> str:
        i = bisect.bisect_right(self.starts, address) - 1
        if i >= 0:
            lo, hi, path = self.rows[i]
            if lo <= address < hi:
                return path
        return ""


def shm_backing(batch: Any, daemon_pid: int, maps: Mappings | None = None) -> str | None:
    """The daemon segment the batch's tensors view, or None for a copied (gRPC) batch.

    A batch is all or nothing: every tensor views the same slot, or none does.
    """
    maps = maps or Mappings()
    prefix = os.path.join(SHM_DIR, segment_prefix(daemon_pid))
    files = {maps.file_of(t.data_ptr()) for t in tensors_of(batch) if t.numel()}
    in_shm = {f for f in files if f.startswith(prefix)}
    assert not in_shm or len(files) == 1, f"a batch partly in shared memory: {files}"
    if not in_shm:
        return None
    return os.path.basename(in_shm.pop().removesuffix(" (deleted)"))


def count_shm(batches: list[Any], daemon_pid: int) -> int:
    maps = Mappings()
    return sum(shm_backing(b, daemon_pid, maps) is not None for b in batches)


def iterate_epoch(loader: RemoteDataLoader, deadline_s: float) -> list[Any]:
    """One full epoch, every batch kept; fails (instead of hanging) past ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    kept = []
    for batch in loader:
        kept.append(batch)
        assert time.monotonic() < deadline, f"epoch not finished within {deadline_s}s ({len(kept)} batches so far)"
    return kept


def mapped_segments(pid: int, daemon_pid: int) -> set[str]:
    """The daemon's segments that process ``pid`` maps."""
    prefix = os.path.join(SHM_DIR, segment_prefix(daemon_pid))
    try:
        paths = {m.path for m in psutil.Process(pid).memory_maps() if m.path.startswith(prefix)}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {os.path.basename(p.removesuffix(" (deleted)")) for p in paths}


def daemon_pid(daemon: RunningDaemon) -> int:
    return daemon.process.pid


# ------------------------------------------------------------------ daemons shared by several tests


class SharedDaemon:
    """A module-lived daemon, started on first use and again if a test stopped it.

    At close, a daemon still running must stop cleanly and leave no shared memory behind.
    """

    def __init__(self, datasets_cfg: dict[str, Any], **options: Any) -> None:
        self.datasets_cfg = datasets_cfg
        self.options = options
        self.daemon: RunningDaemon | None = None
        self.started = contextlib.ExitStack()

    def get(self) -> RunningDaemon:
        if self.daemon is not None and self.daemon.process.poll() is None:
            return self.daemon
        self.daemon = self.started.enter_context(
            running_daemon(
                self.datasets_cfg, prefix="ld-shm-", expect_running=False, python_path=PYTHON_PATH, **self.options
            )
        )
        return self.daemon

    def close(self) -> None:
        daemon = self.daemon
        was_running = daemon is not None and daemon.process.poll() is None
        self.started.close()
        if was_running:
            assert shm_entries(daemon_pid(daemon)) == [], "daemon left shared memory behind"


@pytest.fixture(scope="module")
def roomy(ramp: None) -> Iterator[SharedDaemon]:
    """Default shm cap (1 GiB per worker), unix socket and TCP."""
    shared = SharedDaemon(
        {"mid": ramp_cfg(MID_SHAPE, MID_N), "big": ramp_cfg(BIG_SHAPE, BIG_N)},
        tcp=True,
    )
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def cramped(ramp: None) -> Iterator[SharedDaemon]:
    """4 MiB of shared memory per worker: two 2 MiB segments, so held batches fill it at once."""
    shared = SharedDaemon({"big": ramp_cfg(BIG_SHAPE, BIG_N)}, shm_bytes_per_worker=4 * MiB)
    yield shared
    shared.close()


def big_dataset() -> Any:
    return shm_ramp.Ramp(BIG_SHAPE, BIG_N)


def mid_dataset(n: int = MID_N) -> Any:
    return shm_ramp.Ramp(MID_SHAPE, n)


# ------------------------------------------------------------------ 1. held batches never change


@pytest.mark.timeout(90)
def test_replay_buffer_of_shm_batches_never_changes(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    # prefetch_factor 2 (a window of 4): the default lets small batches run 16 a worker ahead, a whole
    # epoch of 25, and then every batch can take a new slot before any dropped one comes back.
    loader, want = shuffled(daemon.address, "mid", mid_dataset(), MID_BATCH, seed=11, epochs=5, prefetch_factor=2)

    # Epochs 0-2: every batch is kept (each holds its slot; none may be reused).
    kept: list[list[Any]] = [iterate_epoch(loader, 30) for _ in range(3)]
    for epoch in range(3):
        assert count_shm(kept[epoch], pid) == len(kept[epoch]), (
            f"epoch {epoch}: with 1 GiB per worker every batch should arrive through shared memory"
        )
    # Epochs 3-4: keep only odd batches; the even ones are dropped at once, so their
    # slots go back to the workers and are reused while the odd ones stay held.
    segments_before = set(segment_sizes(pid))
    for epoch in (3, 4):
        deadline = time.monotonic() + 30
        held = []
        for i, batch in enumerate(loader):
            assert_same(batch, want[epoch][i], f"epoch {epoch} batch {i}")
            held.append(batch if i % 2 else None)
            del batch
            assert time.monotonic() < deadline, f"epoch {epoch} not finished within 30s"
        kept.append(held)
    gc.collect()
    new_segments = len(set(segment_sizes(pid)) - segments_before)
    assert new_segments < len(want[3]) + len(want[4]), "no slot was reused: the test did not exercise reuse"
    slots = [shm_backing(b, pid) for epoch in kept for b in epoch if b is not None]
    assert len(set(slots)) == len(slots), "two batches held at once share a slot"

    for epoch in range(3):
        assert_same_batches(kept[epoch], want[epoch], f"kept epoch {epoch}")
    for epoch in (3, 4):
        for i, batch in enumerate(kept[epoch]):
            if batch is not None:
                assert_same(batch, want[epoch][i], f"kept epoch {epoch} batch {i}")


@pytest.mark.timeout(90)
def test_full_arena_degrades_to_copies_and_held_batches_stay_intact(cramped: SharedDaemon) -> None:
    daemon = cramped.get()
    pid = daemon_pid(daemon)
    loader, want = shuffled(daemon.address, "big", big_dataset(), BIG_BATCH, seed=5, epochs=3)

    # 24 batches of 1.5 MiB kept against 2 x 4 MiB of shared memory: most cannot get a slot.
    kept = [iterate_epoch(loader, 30) for _ in range(3)]
    flat = [b for epoch in kept for b in epoch]
    in_shm = count_shm(flat, pid)
    assert in_shm >= 1, "no batch came through shared memory"
    assert in_shm <= 4, f"{in_shm} batches held in shared memory, but the cap leaves room for 4"
    assert len(flat) - in_shm >= 1, "the arena never filled up: the test did not exercise the copy path"
    for worker, used in bytes_per_worker(pid).items():
        assert used <= 4 * MiB, f"{worker} uses {used} bytes of /dev/shm, over its 4 MiB cap"
    for epoch in range(3):
        assert_same_batches(kept[epoch], want[epoch], f"kept epoch {epoch}")


# ------------------------------------------------------------------ 2. leases come back


@pytest.mark.timeout(90)
def test_dropped_batches_return_their_slots(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    before = set(segment_sizes(pid))  # what earlier tests left (idle, and too small for these batches)
    window = 4  # prefetch_factor 2 x 2 workers: batches in flight beyond the one the user holds
    epochs = 10
    loader, want = shuffled(daemon.address, "big", big_dataset(), BIG_BATCH, seed=21, epochs=epochs, prefetch_factor=2)

    created: list[int] = []
    delivered_in_shm = 0
    for epoch in range(epochs):
        deadline = time.monotonic() + 30
        n = 0
        for i, batch in enumerate(loader):
            assert_same(batch, want[epoch][i], f"epoch {epoch} batch {i}")
            delivered_in_shm += shm_backing(batch, pid) is not None
            n += 1
            del batch
            assert time.monotonic() < deadline, f"epoch {epoch} not finished within 30s"
        assert n == len(want[epoch])
        gc.collect()
        created.append(len(set(segment_sizes(pid)) - before))

    # 1 GiB per worker: had leases leaked, every batch would have taken a new segment.
    assert delivered_in_shm == epochs * len(want[0]), f"only {delivered_in_shm} batches came through shared memory"
    # At most: the window, the batches received ahead of the user, the user's, and releases on their way.
    bound = 3 * window
    assert created[-1] <= bound, f"segments after each epoch: {created}; leases are not coming back"
    assert created[-1] <= created[1] + 2, f"segments keep growing after the second epoch: {created}"
    assert delivered_in_shm >= 5 * created[-1], f"{delivered_in_shm} batches over {created[-1]} segments: little reuse"


def release_routes(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The leases this process gives back from now on: (those plan messages carry, those the session sends)."""
    by_plan: list[int] = []
    by_session: list[int] = []
    take, tick = ShmSession.take_released, Leases.tick

    def counted_take(self: ShmSession, stream_token: int) -> list[int]:
        leases = take(self, stream_token)
        by_plan.extend(leases)
        return leases

    def counted_tick(self: Leases) -> Tick:
        found = tick(self)
        by_session.extend(found.due)
        return found

    monkeypatch.setattr(ShmSession, "take_released", counted_take)
    monkeypatch.setattr(Leases, "tick", counted_tick)
    return by_plan, by_session


def shm_epochs(daemon: RunningDaemon, epochs: int, **remote_only: Any) -> int:
    """Run ``epochs`` shuffled epochs of "mid" over shared memory, checked against torch; the batches they had."""
    loader, want = shuffled(daemon.address, "mid", mid_dataset(), MID_BATCH, seed=5, epochs=epochs, **remote_only)
    pid = daemon_pid(daemon)
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            assert_same(batch, want[epoch][i], f"epoch {epoch} batch {i}")
            assert shm_backing(batch, pid) is not None, f"epoch {epoch} batch {i} did not come through shared memory"
        # (No `del batch`: as in a training loop, a batch dies when the next one takes its name.)
    del batch
    return epochs * len(want[0])


@pytest.mark.timeout(90)
def test_plans_carry_the_releases_of_dropped_batches(roomy: SharedDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Protocol revision 5: a dropped batch's lease rides its stream's next plan message; the session
    call sends only what no plan took (an epoch's last batches), several leases to a message."""
    by_plan, by_session = release_routes(monkeypatch)
    # A lease waits one to two periods for a plan. At the product's 5 ms, a loop slower than ~5 ms a
    # batch (a loaded 2-core CI machine: 34 of 75 once) sends most by the session, as designed; a
    # longer period makes the count below depend on the routing, not on the machine's speed.
    monkeypatch.setattr(loaderd.shm.session, "RELEASE_PERIOD_S", 0.05)
    batches = shm_epochs(roomy.get(), 3, prefetch_factor=4)
    # Earlier tests' batches share this process's session: their leases may be among those sent.
    wait_for(lambda: len(by_plan) + len(by_session) >= batches, 5, "every dropped batch's lease to go back")
    assert len(set(by_plan + by_session)) == len(by_plan) + len(by_session), "a lease went back twice"
    # The window (4 x 2 workers: the default's 8 a worker would send the plan of an epoch's last 16 earlier, and
    # their leases by the session) is planned a quarter at a time: every plan but the epoch's first
    # carries the leases dropped since the previous one, and only the last ~9 of each epoch's 25 go
    # by the session.
    assert len(by_plan) >= batches // 2, f"{len(by_plan)} of {batches} leases rode plans, {len(by_session)} the session"


@pytest.mark.timeout(90)
def test_each_epochs_final_stretch_tells_the_session_to_send_its_releases_soon(roomy: SharedDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """While plans carry the releases the session's tick backs off (loaderd.shm.release_period); once an
    epoch's plan is out (its final stretch) the iterator tells the session, once per epoch, so the batches
    dropped after (no plan of theirs follows) go back at the shortest period. (The period's own rules are
    tests/unit/test_release_period.py's; this checks the wiring, and that every lease still goes back.)"""
    ended: list[int] = []
    hurry_releases = ShmSession.hurry_releases

    def counted(self: ShmSession) -> None:
        ended.append(self.session_id)
        hurry_releases(self)

    monkeypatch.setattr(ShmSession, "hurry_releases", counted)
    by_plan, by_session = release_routes(monkeypatch)
    batches = shm_epochs(roomy.get(), 3)
    assert len(ended) == 3 and len(set(ended)) == 1, f"last plans told the session {ended}"
    wait_for(lambda: len(by_plan) + len(by_session) >= batches, 5, "every dropped batch's lease to go back")


# ------------------------------------------------------------------ 6. transport choice


SESSION_HOLDER = r"""
import sys, time
from loaderd import RemoteDataLoader

loader = RemoteDataLoader("squares", batch_size=8, address=sys.argv[1], transport="shm")
next(iter(loader))
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(90)
def test_auto_streams_over_grpc_from_a_sole_daemon_at_max_sessions(start_daemon: Callable[..., RunningDaemon]) -> None:
    """Before, such a loader waited for the daemon like one that is down, then raised DaemonUnavailableError."""
    daemon = start_daemon(
        {"squares": SQUARES_CFG, "mid": ramp_cfg(MID_SHAPE, MID_N)}, python_path=PYTHON_PATH, limits={"max_sessions": 1}
    )
    pid = daemon_pid(daemon)
    with client_process(SESSION_HOLDER, daemon.address) as holder:
        holder.read_until(lambda line: line.startswith("holding"), 60, "the other client did not take the only session")
        loader, want = shuffled(daemon.address, "mid", mid_dataset(), MID_BATCH, seed=3, epochs=2, transport="auto", failover_timeout=5)
        for epoch in range(2):
            got = iterate_epoch(loader, 30)
            assert_same_batches(got, want[epoch], f"auto epoch {epoch}")
            assert count_shm(got, pid) == 0, "the daemon refused this process a session: no batch can be in its shared memory"
        with pytest.raises(loaderd.DaemonUnavailableError, match="max_sessions"):
            RemoteDataLoader("mid", batch_size=MID_BATCH, address=daemon.address, transport="shm", failover_timeout=1)


@pytest.mark.timeout(60)
def test_shm_transport_refused_when_daemon_serves_no_shared_memory(start_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = start_daemon(
        {"squares": SQUARES_CFG, "mid": ramp_cfg(MID_SHAPE, MID_N)}, python_path=PYTHON_PATH, shm_bytes_per_worker=0
    )
    pid = daemon_pid(daemon)
    with pytest.raises(loaderd.TransportError) as error:
        RemoteDataLoader("mid", batch_size=MID_BATCH, address=daemon.address, transport="shm")
    message = str(error.value)
    assert "transport='shm'" in message and daemon.address in message, message
    assert "serves no shared memory" in message and "shm_bytes_per_worker" in message, message

    # "auto" falls back to gRPC: batches big enough for a slot arrive as copies, and correct.
    loader, want = shuffled(daemon.address, "mid", mid_dataset(), MID_BATCH, seed=3, epochs=2, transport="auto")
    got = [iterate_epoch(loader, 30) for _ in range(2)]
    for epoch in range(2):
        assert_same_batches(got[epoch], want[epoch], f"auto epoch {epoch}")
        assert count_shm(got[epoch], pid) == 0
    squares = list(RemoteDataLoader("squares", batch_size=8, address=daemon.address))
    assert_same_batches(squares, list(DataLoader(datasets.Squares(SQUARES_N), batch_size=8)), "squares")
    assert shm_entries(pid) == [], "a daemon with shm_bytes_per_worker: 0 created shared memory"


# ------------------------------------------------------------------ 7. TCP on the same host


@pytest.mark.timeout(90)
def test_shm_over_tcp_on_the_same_host(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    tcp = daemon.extra_addresses[0]
    assert tcp.startswith("127.0.0.1:")
    kw = dict(batch_size=MID_BATCH, shuffle=True)
    over_tcp = RemoteDataLoader("mid", address=tcp, transport="shm", generator=seeded(8), **kw)
    over_unix = RemoteDataLoader("mid", address=daemon.address, transport="shm", generator=seeded(8), **kw)
    want = torch_epochs(mid_dataset(), 2, generator=seeded(8), **kw)
    for epoch in range(2):
        got_tcp = iterate_epoch(over_tcp, 30)
        got_unix = iterate_epoch(over_unix, 30)
        assert count_shm(got_tcp, pid) == len(got_tcp), "batches over TCP did not come through shared memory"
        assert_same_batches(got_tcp, got_unix, f"tcp vs unix epoch {epoch}")
        assert_same_batches(got_tcp, want[epoch], f"tcp epoch {epoch}")
    # The session proved it shares /dev/shm with the probe, on a TCP peer.
    log = daemon.log()
    assert re.search(r"session \d+ from ipv4:127\.0\.0\.1:\d+ \(pid %d\): shared memory yes" % os.getpid(), log), log


# ------------------------------------------------------------------ 8. pin_memory


@pytest.mark.timeout(90)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the warning torch gives without an accelerator")
def test_pin_memory_without_cuda_warns_like_torch(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    kw = dict(batch_size=MID_BATCH, shuffle=True)
    loader = RemoteDataLoader("mid", address=daemon.address, transport="shm", pin_memory=True, generator=seeded(9), **kw)
    with pytest.warns(UserWarning, match=r"'pin_memory'.*no accelerator"):
        it = iter(loader)
    got = list(it)
    # torch's DataLoader gives the same warning.
    with pytest.warns(UserWarning, match=r"'pin_memory'.*no accelerator"):
        want = torch_epochs(mid_dataset(), 1, pin_memory=True, generator=seeded(9), **kw)[0]
    assert_same_batches(got, want, "pin_memory epoch")
    assert not any(t.is_pinned() for b in got for t in tensors_of(b))
    assert count_shm(got, daemon_pid(daemon)) == len(got)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_with_cuda_gives_pinned_shm_batches(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    loader, want = shuffled(daemon.address, "big", big_dataset(), BIG_BATCH, seed=10, epochs=2, pin_memory=True)
    for epoch in range(2):
        got = iterate_epoch(loader, 60)
        assert_same_batches(got, want[epoch], f"pinned epoch {epoch}")
        for i, batch in enumerate(got):
            assert all(t.is_pinned() for t in tensors_of(batch)), f"epoch {epoch} batch {i} is not pinned"
            assert torch.equal(batch[0].cuda(non_blocking=True).cpu(), want[epoch][i][0])
        assert count_shm(got, daemon_pid(daemon)) >= 1, "no pinned batch came through shared memory"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_pinned_batches_dropped_before_their_queued_copy_ran_arrive_intact(roomy: SharedDaemon, transport: str) -> None:
    """A training loop drops each host batch right after ``.cuda(non_blocking=True)``, while the copy
    still waits behind queued GPU work; its page-locked memory must not be refilled before the copy ran
    (torch's pinned allocator waits on an event for this; ``loaderd.shm.copy_fence`` does it for slots)."""
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    # prefetch_factor 2, as in the replay-buffer test: a window under an epoch, so that dropped slots are refilled.
    loader, want = shuffled(
        daemon.address, "mid", mid_dataset(), MID_BATCH, seed=11, epochs=2, transport=transport, pin_memory=True, prefetch_factor=2
    )
    for epoch in range(2):
        on_gpu, slots = [], []
        for batch in loader:
            slots.append(shm_backing(batch, pid))
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work queued ahead of the copy
            on_gpu.append([t.cuda(non_blocking=True) for t in tensors_of(batch)])
            del batch  # the last host view is gone: the slot may go back, the copy has not run
        torch.cuda.synchronize()
        assert len(on_gpu) == len(want[epoch])
        for i, tensors in enumerate(on_gpu):
            expected = tensors_of(want[epoch][i])
            assert all(torch.equal(x.cpu(), y) for x, y in zip(tensors, expected, strict=True)), (
                f"epoch {epoch} batch {i} changed before its copy ran"
            )
        in_shm = [s for s in slots if s is not None]
        # Over shm, batches are views of registered slots (before the fence, batch 0 came back
        # changed on an H100: its slot was refilled while the copy waited); over gRPC, torch's own.
        assert in_shm if transport == "shm" else not in_shm, slots


# ------------------------------------------------------------------ 9. file modes


@pytest.mark.timeout(90)
def test_segments_are_private_to_the_user(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    loader = RemoteDataLoader("big", batch_size=BIG_BATCH, address=daemon.address, transport="shm")
    it = iter(loader)
    held = next(it)
    slot = shm_backing(held, pid)
    assert slot is not None, "the batch did not come through shared memory"
    names = shm_entries(pid)
    assert slot in names
    for name in names:
        st = os.stat(os.path.join(SHM_DIR, name))
        # Segments and probes are files; the direct socket (server/rpc/direct_listener.py) is the one socket.
        kind = stat.S_ISSOCK if name.endswith(f"-{DIRECT_SOCKET_SUFFIX}") else stat.S_ISREG
        assert kind(st.st_mode), f"{name} is not a {'socket' if kind is stat.S_ISSOCK else 'regular file'}"
        assert stat.S_IMODE(st.st_mode) == 0o600, f"{name} has mode {oct(stat.S_IMODE(st.st_mode))}, not 0o600"
        assert st.st_uid == os.getuid()
    assert_same(held, next(iter(DataLoader(big_dataset(), batch_size=BIG_BATCH))), "held batch")
    it.close()


# ------------------------------------------------------------------ 10. mixed batch sizes


@pytest.mark.timeout(120)
def test_mixed_batch_sizes_evict_idle_small_segments(
    start_daemon: Callable[..., RunningDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 16 * MiB
    daemon = start_daemon(
        {"small": ramp_cfg(MID_SHAPE, 512), "big": ramp_cfg(BIG_SHAPE, BIG_N)},
        python_path=PYTHON_PATH,
        shm_bytes_per_worker=cap,
    )
    pid = daemon_pid(daemon)
    small, want_small = shuffled(daemon.address, "small", mid_dataset(512), MID_BATCH, seed=1, epochs=2)
    big, want_big = shuffled(daemon.address, "big", big_dataset(), BIG_BATCH, seed=2, epochs=2)

    by_plan, by_session = release_routes(monkeypatch)
    for round_ in range(2):
        # 64 small batches (128 KiB) kept at once: each worker fills its cap with 1 MiB segments.
        got = iterate_epoch(small, 30)
        assert_same_batches(got, want_small[round_], f"small epoch {round_}")
        small_in_shm = count_shm(got, pid)
        assert small_in_shm >= 1
        usage = bytes_per_worker(pid)
        assert len(usage) == 2 and all(used <= cap for used in usage.values()), usage
        if round_ == 0:
            sizes = segment_sizes(pid)
            assert set(sizes.values()) == {MiB}, sizes
            assert all(used == cap for used in usage.values()), f"held small batches did not fill the arena: {usage}"
        given_back = len(by_plan) + len(by_session)
        del got
        gc.collect()
        # The daemon evicts only what it knows is idle: a big epoch whose whole window went out before
        # the small batches' leases came back would be made over gRPC (as it should), unseen here.
        wait_for(
            lambda: len(by_plan) + len(by_session) >= given_back + small_in_shm, 5, "the small batches' leases to go back"
        )

        # Now the idle 1 MiB segments must make room for bigger ones.
        got = iterate_epoch(big, 30)
        assert_same_batches(got, want_big[round_], f"big epoch {round_}")
        in_shm = count_shm(got, pid)
        assert in_shm >= 1, f"big epoch {round_}: no batch came through shared memory (idle small segments not evicted)"
        usage = bytes_per_worker(pid)
        assert all(used <= cap for used in usage.values()), usage
        assert any(size > MiB for size in segment_sizes(pid).values())
        del got
        gc.collect()


@pytest.mark.timeout(10)
def test_segment_sizes_waste_at_most_a_fifth() -> None:
    assert loaderd_arena.segment_size(1) == loaderd_arena.segment_size(MiB) == MiB
    assert loaderd_arena.segment_size(12 * MiB) == 12 * MiB  # f32 3x64x64 x 256: no rounding up
    assert loaderd_arena.segment_size(38_535_168) == 40 * MiB  # 64 images of 3x224x224 float32 (was 64 MiB)
    for nbytes in [MiB + 1, 3 * MiB - 7, 5 * MiB + 12345, 1 << 31, (1 << 31) + 1, 987_654_321]:
        size = loaderd_arena.segment_size(nbytes)
        assert nbytes <= size <= 1.25 * nbytes and size % 4096 == 0, (nbytes, size)


# ------------------------------------------------------------------ 4. SIGKILL the daemon


@pytest.mark.timeout(120)
def test_sigkilled_daemon_workers_exit_client_fails_and_next_daemon_sweeps(
    start_daemon: Callable[..., RunningDaemon],
) -> None:
    n = 2000
    daemon = start_daemon({"mid": ramp_cfg(MID_SHAPE, n)}, python_path=PYTHON_PATH)
    pid = daemon_pid(daemon)
    loader = RemoteDataLoader("mid", batch_size=MID_BATCH, address=daemon.address, transport="shm", failover_timeout=1.0)
    want = list(DataLoader(mid_dataset(n), batch_size=MID_BATCH))
    it = iter(loader)
    held = [next(it) for _ in range(5)]
    assert count_shm(held, pid) == 5

    below = [p.pid for p in descendants(pid)]
    workers = [p for p in below if mapped_segments(p, pid)]
    assert len(workers) >= 1, f"no worker process maps a segment (processes below the daemon: {below})"
    # The daemon is killed hard, and one worker with it (as an OOM kill of the
    # whole group would); the others must notice and leave on their own.
    victim = workers[0]
    victim_segments = mapped_segments(victim, pid)
    survivors = [p for p in below if p != victim]
    assert survivors, "nothing but the victim ran below the daemon"
    try:
        os.kill(victim, signal.SIGSTOP)  # it cannot react (and unlink) between the two kills
        os.kill(pid, signal.SIGKILL)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        killed_wall = time.time()
        assert daemon.process.wait(10) == -signal.SIGKILL
        # What the killed worker left behind.
        left = shm_entries(pid)
        assert victim_segments & set(left), f"the killed worker's segments {victim_segments} are gone already: {left}"

        # The client: an error, not a hang (batches it had already received may come first: up to its window).
        started = time.monotonic()
        extra = []
        with pytest.raises(loaderd.DaemonUnavailableError):
            for _ in range(2 * MAP_PREFETCH + 10):
                extra.append(next(it))
        assert time.monotonic() - started < 10, "the client took too long to notice the daemon is gone"
        # What the daemon sent before it died still arrives: at most its window (2 workers).
        assert len(extra) <= 2 * MAP_PREFETCH, f"{len(extra)} more batches from a dead daemon"
        for i, batch in enumerate(held + extra):
            assert_same(batch, want[i], f"batch {i} after the daemon died")

        # A new daemon removes the dead one's segments before it serves.
        fresh = start_daemon({"mid": ramp_cfg(MID_SHAPE, MID_N)}, python_path=PYTHON_PATH)
        assert shm_entries(pid) == [], f"the new daemon left the dead daemon's segments: {shm_entries(pid)}"
        swept = re.search(r"removed \d+ shared-memory segments left by a daemon that was killed", fresh.log())
        others = daemons_started_since(killed_wall, exclude={daemon_pid(fresh)})
        # Another daemon started meanwhile (tests running beside this one) may have swept first.
        assert swept or others, f"the new daemon did not log its sweep:\n{fresh.log()}"
        # Unlinked but still mapped: the held batches are intact.
        for i, batch in enumerate(held):
            assert_same(batch, want[i], f"held batch {i} after the sweep")

        # The rest of the killed daemon's processes (fork server, workers, resource tracker) exit on their own.
        remaining = max(1.0, 10.0 - (time.monotonic() - killed_at))
        try:
            wait_for(lambda: not any(pid_alive(p) for p in survivors), remaining, "")
        except AssertionError:
            still = {p: cmdline(p) for p in survivors if pid_alive(p)}
            raise AssertionError(f"10 s after the daemon was SIGKILLed these processes of it still run: {still}") from None
    finally:
        # Never leak them into the rest of the run. The resource tracker goes last and
        # on its own if it can: it unlinks the pool's semaphores (/dev/shm/sem.mp-*).
        trackers = [p for p in survivors if "resource_tracker" in cmdline(p)]
        for p in survivors:
            if p not in trackers and pid_alive(p):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in trackers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in trackers:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def daemons_started_since(since: float, exclude: set[int]) -> list[int]:
    """Other `loaderd serve` processes started after ``since`` (seconds since the epoch)."""
    found = []
    for process in psutil.process_iter(["pid", "create_time"]):
        if process.pid in exclude or process.info["create_time"] is None or process.info["create_time"] < since - 1:
            continue
        command = cmdline(process)
        if "loaderd" in command and " serve" in command:
            found.append(process.pid)
    return found


# ------------------------------------------------------------------ 3. SIGKILL a client


CLIENT_SCRIPT = r"""
import sys, time
from loaderd import RemoteDataLoader

address, dataset, n, daemon_pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
loader = RemoteDataLoader(dataset, batch_size=32, address=address, transport="shm")
it = iter(loader)
kept = [next(it) for _ in range(n)]
prefix = "/dev/shm/loaderd-%s-" % daemon_pid
rows = []
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(maxsplit=5)
        if len(parts) > 5 and parts[5].startswith(prefix):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            rows.append((lo, hi))
in_shm = sum(any(lo <= b[0].data_ptr() < hi for lo, hi in rows) for b in kept)
print("ready", in_shm, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_sigkilled_client_gives_its_slots_back(cramped: SharedDaemon) -> None:
    daemon = cramped.get()
    pid = daemon_pid(daemon)
    with client_process(CLIENT_SCRIPT, daemon.address, "big", "6", str(pid)) as client:
        # A window of 2, not the epoch's 8: after the kill, an epoch's later batches are planned once its
        # first ones came, by which time the previous epoch's dropped leases reached the daemon (the session
        # sends them 5-10 ms after the drop). With the whole epoch planned at once, a worker could collate
        # all 8 before that news came, and the epoch, correct, used no slot at all.
        loader, want = shuffled(daemon.address, "big", big_dataset(), BIG_BATCH, seed=4, epochs=4, prefetch_factor=1)
        output = client.read_until(lambda line: line.startswith("ready"), 60, "the client was not ready")
        held_in_shm = int(output[-1].split()[1])
        assert held_in_shm == 4, f"the client holds {held_in_shm} slots; 2 workers x 4 MiB / 2 MiB = 4 expected"

        # Every slot is leased to the other client: this epoch must come as copies.
        got = iterate_epoch(loader, 30)
        assert_same_batches(got, want[0], "epoch while the other client holds every slot")
        assert count_shm(got, pid) == 0, "a slot held by another client was handed out again"
        del got
        gc.collect()

        client.sigkill()

    # The killed client's slots came back: full epochs, correct, through shared memory again.
    in_shm = []
    for epoch in range(1, 4):
        got = iterate_epoch(loader, 30)
        assert_same_batches(got, want[epoch], f"epoch {epoch} after the client was killed")
        in_shm.append(count_shm(got, pid))
        del got
        gc.collect()
    assert in_shm[-1] >= 1, f"batches in shared memory per epoch after the kill: {in_shm}; the slots never came back"
    # The daemon says so: the killed client's session ended holding its slots.
    opened = re.search(r"session (\d+) from \S+ \(pid %d\): shared memory yes" % client.process.pid, daemon.log())
    assert opened, daemon.log()
    ended = re.compile(r"session %s \(.*\) ended holding %d slots; released" % (opened.group(1), held_in_shm))
    wait_for(lambda: ended.search(daemon.log()), 10, f"the daemon to log {ended.pattern!r}")

    del loader
    gc.collect()
    assert daemon.stop() == 0, daemon.log()
    assert shm_entries(pid) == [], f"left in /dev/shm after SIGTERM: {shm_entries(pid)}"


# ------------------------------------------------------------------ 5. SIGTERM cleans up


@pytest.mark.timeout(90)
def test_sigterm_removes_segments_and_probes(roomy: SharedDaemon) -> None:
    daemon = roomy.get()
    pid = daemon_pid(daemon)
    # Several sessions (each made a probe file) and a batch held across the shutdown.
    for address in (daemon.address, *daemon.extra_addresses):
        RemoteDataLoader("mid", batch_size=MID_BATCH, address=address, transport="shm")
    loader = RemoteDataLoader("mid", batch_size=MID_BATCH, address=daemon.address, transport="shm")
    it = iter(loader)
    held = next(it)
    assert shm_backing(held, pid) is not None
    entries = shm_entries(pid)
    assert entries, "no segments while a batch is held"
    # Each session's challenge file lives as long as the session: its process holds it locked (server/rpc/liveness.py).
    probes = [e for e in entries if "probe" in e]
    assert len(probes) == daemon_status(daemon.address).sessions == 2, f"probe files are not one per session: {entries}"
    it.close()

    assert daemon.stop() == 0, daemon.log()
    assert not daemon.socket_path.exists()
    assert shm_entries(pid) == [], f"left in /dev/shm after SIGTERM: {shm_entries(pid)}"
    assert_same(held, next(iter(DataLoader(mid_dataset(), batch_size=MID_BATCH))), "batch held across shutdown")
