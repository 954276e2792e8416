"""The one fact both sides read from their kernel: its boot id.

Equal boot ids mean one host, hence one ``/dev/shm`` and visible ``ipc://`` socket files.
This is the only file read in ``proto``: the server announces the id and the client compares
it, so both must read it the same way.
"""

from __future__ import annotations

from pathlib import Path

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def read_boot_id(path: Path = BOOT_ID_FILE) -> str:
    """This kernel's boot id, or ``""`` where there is none (not Linux, no /proc)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""
