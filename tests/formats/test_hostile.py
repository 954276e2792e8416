"""Hostile inputs are refused with one clear line, before they cost memory: sparse tar
members, compressed bombs, links, devices and ``..`` paths in tars, pickled members, image
folder links out of the folder, samples past ``--max-sample-bytes``."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest
from tests.support.slowness import scaled

#: Runs one ingest in a fresh interpreter and prints its peak RSS (MB) and the error. VmHWM,
#: not ru_maxrss: Linux carries the forking parent's peak into a child's ru_maxrss.
_MEASURED = """
import re, sys
from shardserve.proto.errors import InvalidDataError
from shardserve.server.store.ingest.run import ingest
try:
    ingest(sys.argv[1], sys.argv[2], "bomb", progress=False)
    err = "published"
except InvalidDataError as e:
    err = str(e)
with open("/proc/self/status") as f:
    print(int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) // 1024)
print(err)
"""
#: A bound on the ingest process's peak RSS (MB): the interpreter, numpy, pyarrow and the
#: reader; a member read whole would be 300+ MB more.
RSS_BOUND_MB = 250


def _measured(src: Path, store: Path) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURED, str(src), str(store)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        check=True,
    ).stdout.splitlines()
    return int(out[0]), out[1]


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write a sparse member")
def test_sparse_tar_member_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 10 kB tar whose sparse member says 1.5 GB: refused by its header, RSS stays low."""
    (tmp_path / "src").mkdir()
    big = tmp_path / "k0.bin"
    with open(big, "wb") as f:
        f.truncate(1_500_000_000)
    subprocess.run(
        ["tar", "--sparse", "-cf", str(tmp_path / "src" / "s.tar"), "-C", str(tmp_path), "k0.bin"],
        check=True,
    )
    big.unlink()
    assert (tmp_path / "src" / "s.tar").stat().st_size < 100_000
    rss, err = _measured(tmp_path / "src", tmp_path / "store")
    assert "member is 1500000000 bytes, more than --max-sample-bytes 268435456" in err
    assert rss < RSS_BOUND_MB, rss
    assert not (tmp_path / "store" / "bomb").exists()


def test_compressed_tar_bomb_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    """A gzip-compressed tar (< 1 MB) of a 300 MB member: refused, RSS stays low."""
    (tmp_path / "src").mkdir()
    size = 300 << 20
    with tarfile.open(tmp_path / "src" / "b.tgz", "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("k0.bin")
        info.size = size

        class Zeros(io.RawIOBase):
            left = size

            def readable(self) -> bool:
                return True

            def readinto(self, b: memoryview) -> int:  # type: ignore[override]
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros(), 1 << 20))
    assert (tmp_path / "src" / "b.tgz").stat().st_size < 2_000_000
    rss, err = _measured(tmp_path / "src", tmp_path / "store")
    assert f"member is {size} bytes, more than --max-sample-bytes" in err
    assert rss < RSS_BOUND_MB, rss


def _tar(path: Path, *members: tarfile.TarInfo) -> Path:
    path.mkdir()
    with tarfile.open(path / "x.tar", "w") as tar:
        ok = tarfile.TarInfo("k0.cls")
        ok.size = 1
        tar.addfile(ok, io.BytesIO(b"1"))
        for m in members:
            tar.addfile(m, io.BytesIO(b"\0" * m.size) if m.isfile() else None)
    return path


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.size, m.linkname = kind, size, link
    return m


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_member("k1.jpg", tarfile.SYMTYPE, link="/etc/passwd"), "a link in a tar is refused"),
        (_member("k1.jpg", tarfile.LNKTYPE, link="k0.cls"), "a link in a tar is refused"),
        (_member("k1.jpg", tarfile.CHRTYPE), "a device or fifo member"),
        (_member("../../k1.jpg", size=3), "outside the tar's own tree"),
        (_member("/abs/k1.jpg", size=3), "outside the tar's own tree"),
        (_member("k1.pyd", size=3), "a pickled member is never loaded"),
    ],
    ids=["symlink", "hardlink", "device", "dotdot", "absolute", "pickle"],
)
def test_tar_members_that_are_not_plain_samples_are_refused(
    tmp_path: Path, member: tarfile.TarInfo, message: str
) -> None:
    src = _tar(tmp_path / "src", member)
    with pytest.raises(InvalidDataError, match=rf"x\.tar member .*{message}"):
        ingest(src, tmp_path / "store", "t", progress=False)
    assert not (tmp_path / "store" / "t").exists()


def test_image_folder_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(b"not for trainers")
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
    (tmp_path / "src" / "cat" / "b.jpg").symlink_to(outside)
    with pytest.raises(InvalidDataError, match=r"b\.jpg: a link to .*secret\.jpg, outside"):
        ingest(tmp_path / "src", tmp_path / "store", "img", progress=False)
    # A link that stays inside the folder is fine.
    (tmp_path / "src" / "cat" / "b.jpg").unlink()
    (tmp_path / "src" / "cat" / "b.jpg").symlink_to(tmp_path / "src" / "cat" / "a.jpg")
    s = ingest(tmp_path / "src", tmp_path / "store", "img", progress=False)
    assert s.manifest.num_samples == 2


def test_samples_past_max_sample_bytes_are_refused(tmp_path: Path) -> None:
    """The bound holds for every source, naming the flag: a .pt sample and a block source."""
    (tmp_path / "pt").mkdir()
    torch.save({"x": torch.zeros(4096)}, tmp_path / "pt" / "0.pt")
    with pytest.raises(
        InvalidDataError,
        match=r"0\.pt: the sample is \d+ bytes, more than "
        r"--max-sample-bytes 1024",
    ):
        ingest(tmp_path / "pt", tmp_path / "store", "p", progress=False, max_sample_bytes=1024)
    np.savez(tmp_path / "a.npz", x=np.zeros((8, 4096), dtype=np.float32))
    with pytest.raises(InvalidDataError, match=r"a\.npz: one sample is 16384 bytes"):
        ingest(tmp_path / "a.npz", tmp_path / "store", "n", progress=False, max_sample_bytes=1024)
    rows = [[0.0] * (10 if i != 5 else 4096) for i in range(8)]
    pq.write_table(pa.table({"x": rows}), tmp_path / "a.parquet")
    with pytest.raises(InvalidDataError, match=r"a\.parquet rows 0\.\.7 row 5: the sample is 32"):
        ingest(
            tmp_path / "a.parquet", tmp_path / "store", "q", progress=False, max_sample_bytes=1024
        )


def test_npz_declaring_a_huge_row_is_refused_before_reading(tmp_path: Path) -> None:
    """A compressed .npz whose one row is 400 MB: refused from its header, RSS stays low."""
    (tmp_path / "src").mkdir()
    np.savez_compressed(tmp_path / "src" / "b.npz", x=np.zeros((1, 100 << 20), dtype=np.float32))
    assert (tmp_path / "src" / "b.npz").stat().st_size < 2_000_000
    rss, err = _measured(tmp_path / "src", tmp_path / "store")
    assert "one sample is 419430400 bytes ('x': 419430400), more than --max-sample-bytes" in err
    assert rss < RSS_BOUND_MB, rss


def test_hdf5_declaring_a_huge_row_is_refused_before_reading(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "b.h5", "w") as h:  # 1 GiB per row, nothing written
        h.create_dataset("x", shape=(2, 1 << 28), dtype="f4", chunks=(1, 1 << 16))
    with pytest.raises(InvalidDataError, match=r"b\.h5: one sample is 1073741824 bytes"):
        ingest(tmp_path / "b.h5", tmp_path / "store", "h", progress=False)
