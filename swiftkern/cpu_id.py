"""What this CPU is, from /proc/cpuinfo (Linux): its model name, its vendor, its flags."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line's value in /proc/cpuinfo ("" where there is none, or no
    such file): e.g. "model name", "vendor_id" ("GenuineIntel", "AuthenticAMD")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The instruction-set flags of /proc/cpuinfo ("avx512f", "avx512_bf16", ...), once."""
    return frozenset(cpuinfo_field("flags").split())
