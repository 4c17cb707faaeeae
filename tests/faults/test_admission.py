"""Admission per peer (issue 41): one connection's calls, however many and however silent, starve no
other client. Each call is counted against its connection and host from its first instant."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import datasets
from support.compare import assert_same_batches
from support.daemons import RunningDaemon, oracle_loader, running_daemon, wait_for

from loaderd import RemoteDataLoader
from loaderd.server.config.schema import Limits
from loaderd.server.rpc.admission import SESSIONS_PER_CONNECTION, WATCHES_PER_CONNECTION
from loaderd.wire.reasons import Reason, reason_of

DATASETS = {"squares": {"dataset": "support.datasets:Squares", "kwargs": {"n": 64}}}
# The attack outlives the other client's epoch: silent calls are cut only after this.
HANDSHAKE_S = 120.0
METHODS = {
    "stream": "/loaderd.v1.Loader/StreamBatches",
    "session": "/loaderd.v1.Loader/Session",
}


@dataclass
class Attack:
    """Silent calls on one connection, from a thread of their own; ``refused`` counts those refused, by kind."""

    address: str
    calls: dict[str, int]
    refused: dict[str, int] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)  # any other way a call ended while the attack ran
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def run(self) -> None:
        self._loop.run_until_complete(self._attack())

    async def _attack(self) -> None:
        self._stop = asyncio.Event()
        # An option of its own, so no other channel of this process shares the connection.
        async with grpc.aio.insecure_channel(self.address, options=[("loaderd.test.attacker", 1)]) as channel:
            calls = []
            for kind, n in self.calls.items():
                if kind == "watch":
                    watch = health_pb2_grpc.HealthStub(channel).Watch
                    calls += [(kind, watch(health_pb2.HealthCheckRequest())) for _ in range(n)]
                else:
                    method = channel.stream_stream(METHODS[kind])
                    calls += [(kind, method(self._silence())) for _ in range(n)]
            watched = asyncio.gather(*(self._watch_call(kind, call) for kind, call in calls))
            await self._stop.wait()
            for _, call in calls:
                call.cancel()
            await asyncio.wait_for(watched, 30)

    async def _silence(self) -> AsyncIterator[bytes]:
        await self._stop.wait()
        return
        yield b""  # an async generator that sends nothing

    async def _watch_call(self, kind: str, call: grpc.aio.Call) -> None:
        try:
            async for _ in call:  # a watch's first reply (SERVING) arrives; nothing else does until it is cancelled
                pass
        except asyncio.CancelledError:
            pass  # cancelled at the attack's end
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(exc) is Reason.ADMISSION_LIMIT:
                self.refused[kind] = self.refused.get(kind, 0) + 1
            elif not self._stop.is_set():
                self.other.append(f"{kind}: {exc.code()} {exc.details()}")

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)


@pytest.fixture
def daemon() -> Iterator[RunningDaemon]:
    with running_daemon(DATASETS, prefix="loaderd-admit-", workers=1, tcp=True, limits={"handshake_timeout": HANDSHAKE_S}) as d:
        yield d


@pytest.mark.timeout(120)
def test_1100_silent_calls_on_one_connection_starve_no_other_client(daemon: RunningDaemon) -> None:
    address = daemon.extra_addresses[0]  # the attacker and the other client both come from 127.0.0.1
    limits = Limits()
    attack = Attack(address, {"stream": 1100, "session": 40, "watch": 20})
    thread = threading.Thread(target=attack.run, name="attack")
    thread.start()
    try:
        # Counted per connection from the first instant: all but the connection's share are refused at once.
        want = {"stream": 1100 - limits.max_streams_per_client, "session": 40 - SESSIONS_PER_CONNECTION, "watch": 20 - WATCHES_PER_CONNECTION}
        wait_for(lambda: attack.refused == want or attack.other, 60, "the calls over the connection's share to be refused")
        assert not attack.other, attack.other
        # Meanwhile another client on the same host gets its session, streams and a whole epoch, equal to torch's.
        got = list(RemoteDataLoader("squares", batch_size=8, num_workers=2, address=address, timeout=30))
        assert_same_batches(got, list(oracle_loader(datasets.Squares(64), batch_size=8)))
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        assert attack.refused == want and not attack.other, (attack.refused, attack.other)
    finally:
        attack.stop()
        thread.join(30)
    assert not thread.is_alive()
