"""Catalog: what the daemon serves (its datasets and pool size), as the wire describes it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from loaderd.errors import clip
from loaderd.server.worker.tasks import DatasetMeta
from loaderd.v1 import loaderd_pb2 as pb
from loaderd.wire.limits import PROTOCOL_REVISION


class UnknownDatasetError(LookupError):
    """A client named a dataset the config does not define; the message lists those it does."""


def dataset_info(name: str, meta: DatasetMeta) -> pb.DatasetInfo:
    """A dataset as the wire describes it."""
    return pb.DatasetInfo(
        name=name,
        kind=pb.DatasetInfo.ITERABLE if meta.iterable else pb.DatasetInfo.MAP,
        has_length=meta.length is not None,
        length=meta.length or 0,
    )


@dataclass(frozen=True)
class Catalog:
    """The datasets the warm pool built, and the pool's size. Fixed once the pool is ready."""

    datasets: dict[str, DatasetMeta]
    pool_size: int

    def lookup(self, name: str) -> DatasetMeta:
        """A dataset the config defines; UnknownDatasetError naming what exists otherwise."""
        meta = self.datasets.get(name)
        if meta is None:
            known = ", ".join(sorted(self.datasets)) or "none"
            close = difflib.get_close_matches(name, list(self.datasets), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownDatasetError(f"no dataset named {clip(name, 80)!r} in this daemon's config (it defines: {known}){hint}")
        return meta

    def describe(self, name: str) -> pb.DescribeDatasetResponse:
        return pb.DescribeDatasetResponse(
            dataset=dataset_info(name, self.lookup(name)), pool_workers=self.pool_size, protocol_revision=PROTOCOL_REVISION
        )

    def listing(self) -> pb.ListDatasetsResponse:
        return pb.ListDatasetsResponse(
            datasets=[dataset_info(n, m) for n, m in sorted(self.datasets.items())],
            pool_workers=self.pool_size,
        )
