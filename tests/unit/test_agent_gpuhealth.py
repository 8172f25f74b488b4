"""GPU health from NVML: the decision on readings, and the reader against a fake NVML and
against the real library (which, on a machine without an NVIDIA driver, is unavailable)."""

from __future__ import annotations

from typing import Any

import pytest

from elasticpp.agent.supervisor.gpuhealth import (
    GpuReading,
    describe_unhealthy,
    healthy_gpus,
    read_gpu_health,
)


class FakeNvml:
    """The part of pynvml's API the reader uses, with programmable faults."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    class NVMLError(Exception):
        pass

    def __init__(
        self,
        count: int,
        *,
        unreachable: tuple[int, ...] = (),
        ecc: dict[int, int] | None = None,
        no_library: bool = False,
    ) -> None:
        self.count, self.unreachable, self.ecc = count, unreachable, ecc or {}
        self.no_library = no_library
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.no_library:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        if handle in self.unreachable:
            raise self.NVMLError("GPU is lost")
        return f"GPU-{handle}"

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        return self.ecc.get(handle, 0)


def test_unreachable_and_ecc_failing_gpus_are_dropped() -> None:
    nvml = FakeNvml(4, unreachable=(1,), ecc={3: 2})
    readings = read_gpu_health(nvml)
    assert readings is not None and len(readings) == 4
    assert healthy_gpus(readings) == [0, 2]
    text = describe_unhealthy(readings)
    assert text[0].startswith("GPU 1 unreachable") and "GPU 3 has 2 uncorrected" in text[1]
    assert nvml.shutdowns == 1


def test_all_healthy() -> None:
    readings = read_gpu_health(FakeNvml(2))
    assert readings == [GpuReading(0, True), GpuReading(1, True)]


@pytest.mark.parametrize("nvml", ["fake", "real"])
def test_no_driver_means_no_gpu_watching(nvml: str) -> None:
    """The same case against the fake and the real pynvml: this CI machine has no NVIDIA
    driver, so the real library cannot initialise either."""
    module: Any
    if nvml == "fake":
        module = FakeNvml(0, no_library=True)
    else:
        import pynvml

        module = pynvml
    assert read_gpu_health(module) is None
