"""Shared mappings of segment files, holding no descriptor (both sides map worker segments).

Python's ``mmap.mmap`` keeps a duplicate of the descriptor for the mapping's
whole life, so a process mapping thousands of segments ran out of descriptors.
A ``SharedMapping`` holds none: it lives as long as any view of it does and is
unmapped when the last one goes (a finalizer on the buffer, not ``__del__``).
Hooks registered with ``before_unmap`` run first, while the range is still
mapped: a range page-locked for CUDA must be unregistered before it is unmapped,
or the driver keeps the old pages pinned and a later mapping at the same
address looks pinned when it is not.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from collections.abc import Callable

log = logging.getLogger("loaderd.mapping")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

UnmapHook = Callable[[int, int], None]  # (address, size), called once, before munmap


def _unmap(address: int, size: int, hooks: list[UnmapHook]) -> None:
    for hook in hooks:
        try:
            hook(address, size)
        except Exception:
            log.exception("a hook before unmapping %#x failed", address)
    _libc.munmap(address, size)


class SharedMapping:
    """``size`` bytes of file ``fd`` mapped shared; the caller may close ``fd`` at once.

    ``view`` is a byte memoryview of the whole range (read-only unless ``writable``);
    slices and tensors over it keep the mapping alive.
    """

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        address = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self.address: int = address
        self.size = size
        self._hooks: list[UnmapHook] = []
        buffer = (ctypes.c_ubyte * size).from_address(address)
        # The finalizer holds the hook list, not this object: dropping the SharedMapping
        # while tensors still view it leaves the range mapped for them.
        weakref.finalize(buffer, _unmap, address, size, self._hooks)
        view = memoryview(buffer).cast("B")
        self.view = view if writable else view.toreadonly()

    def before_unmap(self, hook: UnmapHook) -> None:
        """Run ``hook(address, size)`` when the last view is gone, before the range is unmapped."""
        self._hooks.append(hook)


def map_fd(fd: int, size: int, writable: bool) -> memoryview:
    """``size`` bytes of file ``fd`` mapped shared, as a byte memoryview (see ``SharedMapping``)."""
    return SharedMapping(fd, size, writable).view
