"""Rewrite a pyarrow wheel without the parts shardserve never loads (Flight,
Gandiva, C++ headers, tests), so the device wheelhouse fits one 64 MiB device call.

    python bench/slim_wheel.py bench/wheelhouse/pyarrow-*.whl

The wheel is rewritten in place with its RECORD updated; ``import pyarrow``, IPC, compute
and Parquet keep working (bench/device_run.sh imports them before anything runs).
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

#: Files dropped: the Flight library and bindings, headers, sources and tests.
DROP = re.compile(
    r"^pyarrow/(libarrow_flight|_flight|libgandiva|gandiva"
    r"|include/|src/|tests/|libarrow_python_flight|.*\.pxd$|.*\.pyx$)"
)


def slim(wheel: Path) -> tuple[int, int]:
    """Rewrite ``wheel`` without :data:`DROP`; its sizes before and after, in bytes."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if DROP.match(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [
                    ln for ln in data.decode().splitlines() if not DROP.match(ln.split(",", 1)[0])
                ]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        b, a = slim(Path(arg))
        print(f"{arg}: {b / 2**20:.1f} MiB -> {a / 2**20:.1f} MiB")
