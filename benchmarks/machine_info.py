"""The machine a benchmark ran on, for its figures: the CPU's model name, the process's CPU count
and the flags that decide PyTorch's fast path (AVX2, AVX-512, bf16, AMX). No torch import: the
drivers (cpu_goals.py) use it too."""

from __future__ import annotations

import os
import platform
from pathlib import Path

FAST_PATH = ("avx2", "fma")  # and every avx512*, amx*, avx_vnni* flag


def cpu_flags() -> str:
    """'MODEL; N CPUs; FLAGS' from Linux's /proc/cpuinfo (elsewhere platform.processor())."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    keep = {f for f in flags if f in FAST_PATH or f.startswith(("avx512", "amx", "avx_vnni"))}
    return f"{name}; {os.cpu_count()} CPUs; " + " ".join(sorted(keep))
