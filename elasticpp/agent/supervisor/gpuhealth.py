"""GPU health through NVML, when it is present (the optional `nvidia-ml-py` dependency).

`read_gpu_health` asks NVML about every GPU the node has; `healthy_gpus` decides from those
readings, purely. A GPU is unhealthy when NVML cannot talk to it (fallen off the bus,
XID 79) or it reports uncorrected ECC errors since the driver loaded. On a machine without
NVML (no driver, CPU-only) the reader returns None and the agent does not watch GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuReading:
    index: int
    reachable: bool
    uncorrected_ecc_errors: int = 0
    error: str = ""


def healthy_gpus(readings: Sequence[GpuReading]) -> list[int]:
    return [r.index for r in readings if r.reachable and r.uncorrected_ecc_errors == 0]


def describe_unhealthy(readings: Sequence[GpuReading]) -> list[str]:
    out = []
    for r in readings:
        if not r.reachable:
            out.append(f"GPU {r.index} unreachable ({r.error})")
        elif r.uncorrected_ecc_errors:
            out.append(f"GPU {r.index} has {r.uncorrected_ecc_errors} uncorrected ECC errors")
    return out


def read_gpu_health(module: Any | None = None) -> list[GpuReading] | None:
    """Readings of every GPU, or None when NVML is not available on this machine."""
    nvml: Any = module
    if nvml is None:
        try:
            import pynvml  # type: ignore[import-untyped]
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        readings = []
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                nvml.nvmlDeviceGetUUID(handle)  # fails for a GPU that fell off the bus
            except nvml.NVMLError as exc:
                readings.append(GpuReading(i, reachable=False, error=str(exc)))
                continue
            try:
                ecc = int(
                    nvml.nvmlDeviceGetTotalEccErrors(
                        handle,
                        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC,
                    )
                )
            except nvml.NVMLError:
                ecc = 0  # ECC not supported or disabled: nothing to read
            readings.append(GpuReading(i, reachable=True, uncorrected_ecc_errors=ecc))
        return readings
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
