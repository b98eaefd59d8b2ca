"""The CPU this process runs on, as /proc/cpuinfo names it: what decides which kernel is fastest here and what a
native build is compiled for."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """CPU model name and flags from /proc/cpuinfo (Linux); the platform's processor string elsewhere."""
    model, flags = platform.processor() or platform.machine(), list[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in (platform.processor(), platform.machine()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = sorted(value.split())
    return {"model": model, "flags": flags, "logical_cpus": os.cpu_count()}
