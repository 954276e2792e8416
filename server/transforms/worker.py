"""The main loop of a transform worker process (started with ``spawn``, never ``fork``).

It loads the same transform modules as the server, then answers requests one at a time:
a chain (names and params), where the batch is, the input fields and the batch's parts;
the reply is the output parts and seconds per transform, or the step that failed.
Compiled chains are cached by their JSON. It exits when its pipe closes.

A request may also name, for fixed-size outputs, a span of a shared-memory file (the
stream's slot ring, by path and offset): the chain writes those outputs straight there and
the reply lists them instead of carrying their bytes. And its inputs may lie in a file the
server keeps for this worker (``meta["in"]``): the worker reads them there, read-only, instead
of from the pipe, which moves 64 KiB per wake-up of the other side (:class:`MappedFiles`).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from . import codec
from .errors import StepFailed
from .registry import TransformRegistry
from .runner import Limits, Where, run_chain
from .schema import Field
from .spec import Chain, compile_chain

#: Seconds between checks that the server still runs.
PARENT_POLL_S = 0.5
#: Seconds an idle worker waits before unmapping files the server has removed.
SWEEP_S = 5.0
#: Files kept mapped at most (the least recently used is unmapped first).
MAX_FILES = 8


class MappedFiles:
    """Shared-memory files this worker reads inputs from and writes outputs into, mapped
    once each. A file the server has removed (its stream ended, a bigger input file
    replaced it) is unmapped at the next request or idle sweep: a mapping would keep its
    memory allocated."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, tuple[tuple[int, int], mmap.mmap]] = OrderedDict()

    def view(
        self,
        span: Mapping[str, Any],
        dtype: np.dtype,
        shape: tuple[int, ...],
        writable: bool = True,
    ) -> np.ndarray:
        """An array of ``shape`` at ``span`` (``path``, ``offset``, ``nbytes``); ``ValueError``
        if it does not lie inside the file or holds another size."""
        path, offset = str(span["path"]), int(span["offset"])
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino)
        hit = self._maps.get(path)
        if hit is None or hit[0] != ident:
            if hit is not None:
                self._unmap(path)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._maps[path] = hit = (ident, mm)
            while len(self._maps) > MAX_FILES:
                self._unmap(next(iter(self._maps)))
        self._maps.move_to_end(path)
        mm = hit[1]
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        fits = offset >= 0 and offset + nbytes <= len(mm) and not offset % dtype.itemsize
        if not fits or nbytes != int(span["nbytes"]):
            raise ValueError(
                f"output span of {span['nbytes']} bytes at {offset} of {path} "
                f"({len(mm)} bytes) does not hold {shape} {dtype}"
            )
        view = np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)
        view.flags.writeable = writable
        return view

    def inputs(self, spec: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The arrays a request laid out in its input file: ``{"path", "arrays": [{"name",
        "dtype", "shape", "offset", "nbytes"}]}``; read-only, as from the pipe."""
        out: dict[str, np.ndarray] = {}
        for a in spec["arrays"]:
            dt = np.dtype(a["dtype"])
            if dt.hasobject:
                raise ValueError(f"array {a['name']!r} has object dtype; refused")
            span = {"path": spec["path"], "offset": a["offset"], "nbytes": a["nbytes"]}
            out[a["name"]] = self.view(span, dt, tuple(a["shape"]), writable=False)
        return out

    def sweep(self) -> None:
        """Unmap files that are gone (or replaced) from their paths."""
        for path, (ident, _) in list(self._maps.items()):
            try:
                st = os.stat(path)
            except OSError:
                self._unmap(path)
                continue
            if (st.st_dev, st.st_ino) != ident:
                self._unmap(path)

    def _unmap(self, path: str) -> None:
        _, mm = self._maps.pop(path)
        with contextlib.suppress(BufferError):  # no view outlives a request
            mm.close()


def _die_with_parent() -> None:
    """End this worker when the server is gone (even by kill -9) while a transform runs:
    a daemon thread watches the parent pid. (``PR_SET_PDEATHSIG`` would fire when the
    server *thread* that started the worker ends, which pool threads do.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="ss-parent-watch", daemon=True).start()


def main(conn: Connection, modules: list[str]) -> None:
    """Serve requests on ``conn`` until it closes."""
    # The server's Ctrl-C reaches the whole process group; the server ends its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    registry = TransformRegistry.load(modules)
    chains: dict[str, Chain] = {}
    files = MappedFiles()
    conn.send_bytes(b"ready")
    while True:
        try:
            while not conn.poll(SWEEP_S):
                files.sweep()
            meta, arrays = codec.recv(conn)
        except (EOFError, OSError):
            return
        try:
            key = json.dumps([meta["chain"], meta["inputs"]], sort_keys=True)
            chain = chains.get(key)
            if chain is None:
                inputs = {
                    n: Field(f["dtype"], tuple(f["shape"]), f["binary"])
                    for n, f in meta["inputs"].items()
                }
                chain = chains[key] = compile_chain(meta["chain"], registry, inputs, "")
            files.sweep()
            reply, parts = _answer(chain, meta, arrays, files)
        except StepFailed as e:
            parts, reply = {}, {"ok": False, "failed": e.to_json()}
        except Exception as e:  # a bug or bad request: still an answer, never a dead pipe
            failed = StepFailed("<worker>", None, None, f"{type(e).__name__}: {e}", False)
            parts, reply = {}, {"ok": False, "failed": failed.to_json()}
        codec.send(conn, reply, parts)


def _answer(
    chain: Chain, meta: Mapping[str, Any], piped: Mapping[str, np.ndarray], files: MappedFiles
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run one request: the reply and the output parts that go back on the pipe.

    Files the server keeps in /dev/shm may be removed under it (systemd-logind's
    ``RemoveIPC``, a container runtime, cron). An input file that is gone is said in the
    reply (``inputs_gone``): the server sends the request again with its inputs on the pipe.
    An output span whose file is gone is left out: that output goes back on the pipe and the
    server copies it into its own mapping of the stream's ring."""
    arrays = dict(piped)  # views of the input file: none outlives this call
    if "in" in meta:
        try:
            arrays.update(files.inputs(meta["in"]))
        except FileNotFoundError as e:
            return {"ok": False, "inputs_gone": f"its input file {e.filename} is gone"}, {}
    indices = arrays.pop("__indices__")
    limits = Limits(**meta.get("limits", {}))
    out: dict[str, np.ndarray] = {}
    for name, span in meta.get("out", {}).items():
        f = chain.outputs[name]
        with contextlib.suppress(FileNotFoundError):
            out[name] = files.view(span, np.dtype(f.dtype), (len(indices), *f.shape))
    parts, spent = run_chain(
        chain, arrays, indices, Where(**meta["where"]), meta["names"], out, limits
    )
    # Written where the server sends the batch from: only their names go back.
    in_place = [n for n, v in out.items() if n in parts and parts[n].ctypes.data == v.ctypes.data]
    parts = {k: v for k, v in parts.items() if k not in in_place}
    del out, arrays  # no view of a file outlives its request
    return {"ok": True, "spent": spent, "in_place": in_place}, parts
