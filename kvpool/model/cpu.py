"""What this CPU can do, read once at run time: the runtime chooses kernels and dtypes by
it (never by what the machine that built or tested kvpool had).

Features come from the CPUID instruction through torch's ``cpuinfo`` (what the process
may really execute: a virtual machine or an emulator that hides AVX-512 hides it here
too), on aarch64 Linux from the kernel's hardware capabilities (``getauxval``), not from
``/proc/cpuinfo``, which an emulator passes through from the host; on macOS from its
``sysctl`` names (``hw.optional.arm.FEAT_DotProd``, ``machdep.cpu.brand_string``).
``KVPOOL_CPU_FEATURES`` narrows them for tests and experiments: a comma list of the
features to keep (``avx2``, or ``none``); it can only take features away.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the model name the OS reports
    avx2: bool  # with FMA: the x86-64 baseline this project's kernels are written for
    avx512: bool  # AVX-512 F/BW/VL/DQ
    avx512_vnni: bool  # int8 dot products (VPDPBUSD)
    avx512_bf16: bool  # bf16 dot products (VDPBF16PS)
    amx: bool  # AMX tiles, and the OS lets this process use them
    dotprod: bool  # aarch64's int8 dot products (SDOT)
    bf16_products: bool  # oneDNN runs bf16 matrix products in hardware (AVX-512 BF16 / AMX)

    def summary(self) -> str:
        """One line: model, architecture and the features that decide kernels."""
        names = [f.name for f in fields(self) if f.type == "bool" and getattr(self, f.name)]
        names = [n for n in names if n != "bf16_products"]
        have = " ".join(n.upper().replace("_", "-") for n in names) or "no SIMD extensions used"
        return f"{self.model} ({self.arch}): {have}"


# Arm's own cores by the part number /proc/cpuinfo gives (implementer 0x41), for CPUs whose
# /proc/cpuinfo names no model (aarch64 Linux: Graviton, Ampere, a Raspberry Pi's).
ARM_PARTS = {
    0xD03: "Cortex-A53", 0xD05: "Cortex-A55", 0xD07: "Cortex-A57", 0xD08: "Cortex-A72",
    0xD0B: "Cortex-A76", 0xD0C: "Neoverse-N1", 0xD0D: "Cortex-A77", 0xD40: "Neoverse-V1",
    0xD41: "Cortex-A78", 0xD49: "Neoverse-N2", 0xD4F: "Neoverse-V2",
}  # fmt: skip


def model_name_from(cpuinfo: str) -> str | None:
    """The CPU's model in /proc/cpuinfo's text: its model name (x86), or on aarch64 the
    core its implementer and part numbers say ("Neoverse-N1", else the numbers)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Model", "Hardware"):
        if fields.get(key):
            return fields[key]
    implementer, part = fields.get("CPU implementer"), fields.get("CPU part")
    if implementer and part:
        try:
            implementer_id, part_id = int(implementer, 0), int(part, 0)
        except ValueError:
            return None
        if implementer_id == 0x41 and part_id in ARM_PARTS:
            return ARM_PARTS[part_id]
        return f"Arm implementer {implementer_id:#x} part {part_id:#x}"
    return None


def _sysctl(name: str) -> bytes | None:
    """The value of a sysctl name as its bytes (macOS, the BSDs), or None where there is
    no such name or no sysctlbyname (Linux)."""
    try:
        import ctypes

        sysctlbyname = ctypes.CDLL(None).sysctlbyname
    except (OSError, AttributeError):
        return None
    size = ctypes.c_size_t(0)
    if sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0) != 0 or not size.value:
        return None
    buffer = ctypes.create_string_buffer(size.value)
    if sysctlbyname(name.encode(), buffer, ctypes.byref(size), None, 0) != 0:
        return None
    return buffer.raw[: size.value]


def _model_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            name = model_name_from(info.read())
    except OSError:  # macOS: "Apple M2" and the like
        brand = _sysctl("machdep.cpu.brand_string")
        name = brand.rstrip(b"\0").decode(errors="replace").strip() if brand else None
    return name or platform.processor() or "unknown CPU"


def _probe(name: str) -> bool:
    import torch

    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


def _aarch64_hwcap(bit: int) -> bool:
    """Bit ``bit`` of the kernel's AT_HWCAP for this process (aarch64 Linux; elsewhere
    False)."""
    if platform.machine() not in ("aarch64", "arm64") or sys.platform == "darwin":
        return False
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype = ctypes.c_ulong
        getauxval.argtypes = [ctypes.c_ulong]
        return bool(getauxval(16) >> bit & 1)  # AT_HWCAP
    except (OSError, AttributeError):  # not glibc / not Linux
        return False


def _macos_arm_feature(name: str) -> bool:
    """Whether macOS on an Arm CPU reports feature ``name`` (``hw.optional.arm.<name>``
    is 1); False elsewhere."""
    if sys.platform != "darwin" or platform.machine() not in ("arm64", "aarch64"):
        return False
    value = _sysctl(f"hw.optional.arm.{name}")
    return value is not None and int.from_bytes(value, "little") != 0


def _mkldnn_bf16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's features (narrowed by ``KVPOOL_CPU_FEATURES`` where set)."""
    found = {
        "avx2": _probe("_is_avx2_supported"),
        "avx512": _probe("_is_avx512_supported"),
        "avx512_vnni": _probe("_is_avx512_supported") and _probe("_is_vnni_supported"),
        "avx512_bf16": _probe("_is_avx512_bf16_supported"),
        # Linux gives a process the tiles' state only when asked (torch's _init_amx asks,
        # as oneDNN and the native module do): without it the tiles cannot run
        "amx": _probe("_is_amx_tile_supported") and _probe("_init_amx"),
        "dotprod": _aarch64_hwcap(20) or _macos_arm_feature("FEAT_DotProd"),  # HWCAP_ASIMDDP
        "bf16_products": _mkldnn_bf16(),
    }
    keep = os.environ.get("KVPOOL_CPU_FEATURES")
    if keep is not None:
        allowed = {name.strip() for name in keep.split(",")}
        found = {name: has and name in allowed for name, has in found.items()}
        # oneDNN reads the CPU itself: its bf16 products go with the features behind them
        found["bf16_products"] = _mkldnn_bf16() and (found["avx512_bf16"] or found["amx"])
    return CpuFeatures(arch=platform.machine(), model=_model_name(), **found)
