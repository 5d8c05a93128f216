"""Reading sysfs/procfs under a root path: small tolerant readers and the PCI display-device scan."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .device import DISPLAY_CLASSES, PCI_VENDORS

# ---------------------------------------------------------------------------------------------
# Reading files that may be missing, unreadable, or odd

def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _hex(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def _int(path: str) -> int:
    text = _read(path)
    try:
        return int(text.strip()) if text else 0
    except ValueError:
        return 0


def _keyvals(path: str) -> dict[str, int]:
    """A KFD properties file: one "key value" per line; values are integers."""
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _natural(s: str) -> tuple:
    """"cuda10" sorts after "cuda2"."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


_PCI_ADDR = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def _norm_pci(addr: str) -> str:
    """"00000000:2B:00.0" (NVML) or "0000:2b:00.0" (sysfs) -> "0000:2b:00.0"; "" when not an address."""
    m = _PCI_ADDR.match(addr.strip())
    if not m:
        return ""
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


@dataclass(frozen=True)
class _Pci:
    addr: str
    vendor: int
    device: int
    cls: int           # 24-bit class code, 0 when unreadable
    revision: int      # -1 when unreadable

    @property
    def is_display(self) -> bool:
        return (self.cls >> 8) in DISPLAY_CLASSES


def _scan_pci(root: str) -> dict[str, _Pci]:
    """Every PCI function under root/sys/bus/pci/devices, by address (plain folders or sysfs symlinks)."""
    base = os.path.join(root, "sys/bus/pci/devices")
    out: dict[str, _Pci] = {}
    for entry in sorted(_listdir(base)):
        addr = _norm_pci(entry)
        d = os.path.join(base, entry)
        vendor, device = _hex(os.path.join(d, "vendor")), _hex(os.path.join(d, "device"))
        if not addr or vendor is None or device is None:
            continue
        cls = _hex(os.path.join(d, "class"))
        rev = _hex(os.path.join(d, "revision"))
        out[addr] = _Pci(addr, vendor, device, cls or 0, -1 if rev is None else rev)
    return out


def _gpus_of(pcis: dict[str, _Pci], vendor: str) -> dict[str, _Pci]:
    return {a: p for a, p in pcis.items() if PCI_VENDORS.get(p.vendor) == vendor and p.is_display}


