"""Baseline: tf.data samples/s on a CIFAR-like dataset, in-process and through tf.data service.

    /path/to/tf-venv/bin/python bench/bench_tfdata.py [--n N] [--batch 256] [--epochs 2]
                                                      [--json out.json]

Runs in an interpreter that has TensorFlow (stdlib + numpy + tensorflow only, no project code).
Data: ``uint8[3,32,32]`` images from ``np.random.default_rng(0)`` and ``int64`` labels
``arange(n) % 10`` (N=50,000 by default, ~150 MB). The arrays are written once to a temp file
of fixed-length raw records (3,072 image bytes + 8 little-endian label bytes), and BOTH
configurations read that file with the same pipeline: ``FixedLengthRecordDataset`` ->
``shuffle(n)`` -> ``map(decode_raw)`` -> ``batch`` -> ``prefetch(AUTOTUNE)``. A file is used
because a ``from_tensor_slices`` graph of 150 MB cannot be shipped to the service in a gRPC
message; reading the same file locally keeps the two rows comparable.

* ``tf.data local``: the pipeline iterated in this process.
* ``tf.data service``: a dispatcher and one worker in a child process (this script with
  ``--serve-service PORTFILE``), on localhost, ``distribute(processing_mode="parallel_epochs")``
  with default settings (incl. compression="AUTO"). Clients only use ``localhost`` addresses,
  but TF has no bind-address option: both servers listen on all interfaces (``[::]:PORT``).

Each configuration runs ``--epochs`` epochs; the last epoch's samples/s is reported, measured
from asking for the iterator to the last batch (so it includes filling the n-element shuffle
buffer), plus each epoch's time to first batch. The consumer loop reads one element of each
tensor of every batch with ``.numpy()``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before the import, or TF logs anyway

import numpy as np
import tensorflow as tf

IMG_BYTES = 3 * 32 * 32
REC_BYTES = IMG_BYTES + 8
PORT_WAIT_S = 60.0
SHUTDOWN_WAIT_S = 30.0


def write_records(n: int, path: Path) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    label = np.arange(n, dtype=np.int64) % 10
    lab = label.astype("<i8").view(np.uint8).reshape(n, 8)
    np.concatenate([image.reshape(n, IMG_BYTES), lab], axis=1).tofile(path)


def decode(rec: tf.Tensor) -> dict[str, tf.Tensor]:
    image = tf.io.decode_raw(tf.strings.substr(rec, 0, IMG_BYTES), tf.uint8)
    label = tf.io.decode_raw(tf.strings.substr(rec, IMG_BYTES, 8), tf.int64, little_endian=True)
    return {"image": tf.reshape(image, (3, 32, 32)), "label": tf.reshape(label, ())}


def pipeline(path: Path, n: int, batch: int) -> tf.data.Dataset:
    # Shuffle the raw records (one string each) so decoding runs in parallel after the buffer.
    ds = tf.data.FixedLengthRecordDataset(str(path), REC_BYTES)
    ds = ds.shuffle(n, reshuffle_each_iteration=True)
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)


def check_file(path: Path, n: int) -> None:
    # Cheap guard that the record layout round-trips; a wrong decode would make numbers moot.
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, (min(n, 4), 3, 32, 32), dtype=np.uint8)
    ds = tf.data.FixedLengthRecordDataset(str(path), REC_BYTES).map(decode).take(len(first))
    for i, el in enumerate(ds):
        assert np.array_equal(el["image"].numpy(), first[i]) and int(el["label"]) == i % 10


def run_epochs(ds: tf.data.Dataset, n: int, epochs: int, timeout_s: float) -> dict:
    first_batch_s: list[float] = []
    samples_s = 0.0
    for _ in range(epochs):
        # A hung service would block next() forever; this dumps stacks and exits instead.
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        t0 = time.perf_counter()
        seen = 0
        for i, b in enumerate(ds):
            if i == 0:
                first_batch_s.append(time.perf_counter() - t0)
            _ = b["image"].numpy().flat[0], b["label"].numpy()[0]
            seen += int(b["label"].shape[0])
        dt = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        if seen != n:
            raise RuntimeError(f"epoch delivered {seen} samples, expected {n}")
        samples_s = n / dt
    return {"samples_s": samples_s, "first_batch_s": first_batch_s}


def serve_service(portfile: Path) -> None:
    """Child process: dispatcher + worker on localhost until the parent closes our stdin."""
    dispatcher = tf.data.experimental.service.DispatchServer(
        tf.data.experimental.service.DispatcherConfig(port=0)
    )
    addr = dispatcher.target.split("://", 1)[1]  # "localhost:PORT"
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=addr, port=0)
    )
    tmp = portfile.with_suffix(".tmp")
    tmp.write_text(addr.rsplit(":", 1)[1])
    tmp.replace(portfile)  # atomic, so the parent never reads half a port
    sys.stdin.read()  # EOF also comes if the parent dies, so the child never outlives it
    del worker, dispatcher


def start_service(tmp: Path) -> tuple[subprocess.Popen, int]:
    portfile = tmp / "port"
    with open(tmp / "service.log", "wb") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-service", str(portfile)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + PORT_WAIT_S
    while not portfile.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_service(proc)
            msg = (tmp / "service.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"no dispatcher port in {portfile} after {PORT_WAIT_S:.0f} s "
                f"(service rc={proc.returncode}); its log:\n{msg}"
            )
        time.sleep(0.1)
    return proc, int(portfile.read_text())


def stop_service(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=SHUTDOWN_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=SHUTDOWN_WAIT_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    ap.add_argument("--epoch-timeout", type=float, default=600.0, help="seconds per epoch")
    ap.add_argument("--serve-service", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_service is not None:
        serve_service(args.serve_service)
        return 0

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_tfdata_") as td:
        tmp = Path(td)
        data = tmp / "cifar.bin"
        write_records(args.n, data)
        check_file(data, args.n)
        ds = pipeline(data, args.n, args.batch)
        rows["tf.data local"] = run_epochs(ds, args.n, args.epochs, args.epoch_timeout)

        proc, port = start_service(tmp)
        try:
            dist = ds.apply(
                tf.data.experimental.service.distribute(
                    processing_mode="parallel_epochs", service=f"grpc://localhost:{port}"
                )
            )
            rows["tf.data service"] = run_epochs(dist, args.n, args.epochs, args.epoch_timeout)
        finally:
            stop_service(proc)

    print(f"tensorflow {tf.__version__}, n={args.n}, batch={args.batch}, epochs={args.epochs}")
    print(f"{'configuration':<18}{'samples/s':>12}  first batch ms per epoch")
    for name, r in rows.items():
        fb = ", ".join(f"{s * 1e3:.0f}" for s in r["first_batch_s"])
        print(f"{name:<18}{r['samples_s']:>12,.0f}  {fb}")
    if args.json is not None:
        out = {"n": args.n, "batch": args.batch, "tensorflow": tf.__version__, "rows": rows}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
