"""The processes a test looks at: a daemon's descendants, whether each still runs, what it runs.

psutil reads /proc for these (and tells a live process from a reused pid by its start time),
so the tests keep no /proc parsing of their own.
"""

from __future__ import annotations

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid`` (fork server, workers, resource tracker), recursively; [] if it is gone."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if alive(p)]
    except psutil.NoSuchProcess:
        return []


def alive(process: psutil.Process) -> bool:
    """Running, sleeping or stopped, and not a later process under a reused pid; a zombie counts as gone."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    """``alive`` for a bare pid (one the test did not hold a Process for)."""
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def cmdline(process: psutil.Process | int) -> str:
    """Its command line, space-joined ("" once it is gone or unreadable)."""
    try:
        proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def still_running(processes: list[psutil.Process]) -> list[str]:
    """``pid: command line`` of each of ``processes`` that still runs."""
    return [f"{p.pid}: {cmdline(p)[:150]}" for p in processes if alive(p)]
