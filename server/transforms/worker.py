"""The main loop of a transform worker process (started with ``spawn``, never ``fork``).

It loads the same transform modules as the server, then answers requests one at a time:
a chain (names and params), where the batch is, the input fields and the batch's parts;
the reply is the output parts and seconds per transform, or the step that failed.
Compiled chains are cached by their JSON. It exits when its pipe closes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from . import codec
from .errors import StepFailed
from .registry import TransformRegistry
from .runner import Limits, Where, run_chain
from .schema import Field
from .spec import Chain, compile_chain

#: Seconds between checks that the server still runs.
PARENT_POLL_S = 0.5


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
    conn.send_bytes(b"ready")
    while True:
        try:
            meta, arrays = codec.recv(conn)
        except (EOFError, OSError):
            return
        try:
            key = json.dumps([meta["chain"], meta["inputs"]], sort_keys=True)
            chain = chains.get(key)
            if chain is None:
                inputs = {n: Field(f["dtype"], tuple(f["shape"]), f["binary"])
                          for n, f in meta["inputs"].items()}  # fmt: skip
                chain = chains[key] = compile_chain(meta["chain"], registry, inputs, "")
            indices = arrays.pop("__indices__")
            limits = Limits(**meta.get("limits", {}))
            parts, spent = run_chain(
                chain, arrays, indices, Where(**meta["where"]), meta["names"], limits=limits
            )
            reply: dict[str, Any] = {"ok": True, "spent": spent}
        except StepFailed as e:
            parts, reply = {}, {"ok": False, "failed": e.to_json()}
        except Exception as e:  # a bug or bad request: still an answer, never a dead pipe
            failed = StepFailed("<worker>", None, None, f"{type(e).__name__}: {e}", False)
            parts, reply = {}, {"ok": False, "failed": failed.to_json()}
        codec.send(conn, reply, parts)
