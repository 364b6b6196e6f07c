"""The host CPU as benchmarks name it beside their figures: this machine class varies ~3x between AVX-512 and
AVX2-only hosts, so a figure without it cannot be compared."""

from __future__ import annotations

import os
import platform
import subprocess


def describe_cpu() -> str:
    """`lscpu`'s model name, the CPUs this process sees, and whether the CPU has AVX-512."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "?"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    name = fields.get("Model name", "?").strip()
    avx512 = "avx512f" in fields.get("Flags", "")
    return f"{name}, {os.cpu_count()} CPUs, {'AVX-512' if avx512 else 'AVX2 only'}"
