"""How long the command has been running, as train.time_budget counts it: since its process
started (or torchrun's, under torchrun), and a step clock that goes on while the machine sleeps."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

LAUNCHER_S = 120.0  # the most a launcher (torchrun) starts before its worker, as the command's
_IMPORTED = time.time()


def process_age() -> float:
    """Seconds since this command started: this process's start or, under torchrun
    (TORCHELASTIC_RUN_ID set), its launcher's, the parent process, where that started at most
    LAUNCHER_S before it (torchrun's own start-up and rendezvous, 5-10 s, are the command's too;
    an older parent, such as an agent restarting a failed worker, is not this start)."""
    own = _age(os.getpid())
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        launcher = _age(os.getppid())
        if own <= launcher <= own + LAUNCHER_S:
            return launcher
    return own


def _age(pid: int) -> float:
    """Seconds since process `pid` started: on Linux from /proc; on other POSIX systems (macOS)
    from `ps`, to the second; elsewhere (Windows) since this module was imported, which misses
    the interpreter's start-up."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time() - _started(pid)


@functools.cache
def _started(pid: int) -> float:
    """When process `pid` started on the wall clock, asked of `ps` once (its elapsed time), or
    when this module was imported where `ps` cannot say."""
    command = ["ps", "-o", "etime=", "-p", str(pid)]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
        return time.time() - elapsed_seconds(out.stdout) - 0.5  # ps rounds down to the second
    except (OSError, ValueError, subprocess.SubprocessError):
        return _IMPORTED


def elapsed_seconds(etime: str) -> int:
    """`ps`'s elapsed time, [[DD-]hh:]mm:ss, in seconds (a ValueError for anything else)."""
    days, _, clock = etime.strip().rpartition("-")
    parts = clock.split(":")
    if not 2 <= len(parts) <= 3 or (days and len(parts) != 3):
        raise ValueError(f"not an elapsed time of ps: {etime!r}")
    seconds = sum(int(p) * 60**i for i, p in enumerate(reversed(parts)))
    return seconds + 86400 * int(days or 0)


def step_clock() -> float:
    """Seconds on a clock that goes on while the machine sleeps, as process_age's does, so that
    a suspended laptop's sleep shows between two steps as a stall (perf_counter's stops on Linux):
    Linux's CLOCK_BOOTTIME (what /proc/uptime counts), macOS's CLOCK_MONOTONIC (which counts
    sleep there), else perf_counter (Windows; fine-grained, unlike its wall clock)."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    if sys.platform == "darwin":
        return time.clock_gettime(time.CLOCK_MONOTONIC)
    return time.perf_counter()
