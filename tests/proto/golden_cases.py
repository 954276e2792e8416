"""The messages pinned byte for byte under tests/proto/golden/.

To change the wire format on purpose, bump PROTOCOL_VERSION, then regenerate with
``python -m tests.proto.golden_cases`` and review the diff of the .bin files.
"""

from __future__ import annotations

from pathlib import Path

from shardserve.proto.errors import ErrorCode
from shardserve.proto.framing import encode, encode_batch
from shardserve.proto.messages import (
    BatchHeader,
    Bye,
    ClientStats,
    Credit,
    EndOfEpoch,
    Error,
    Heartbeat,
    Hello,
    PartHeader,
    Reject,
    ShmRing,
    Welcome,
)

GOLDEN = Path(__file__).parent / "golden"

CONTROL = {
    "hello": Hello(
        job="2f43ada9a6216ad9",
        rank=1,
        epoch=3,
        start_batch=7,
        credit=4,
        nonce=42,
        token="t0k",
        host="node-1",
        boot_id="b00t",
        pid=1234,
        keep=(1, 3),
        group=16,
        offset=8,
        origin="0123456789abcdef",
    ),
    "welcome": Welcome(
        stream=5,
        nonce=42,
        job="2f43ada9a6216ad9",
        rank=1,
        epoch=3,
        seed=0,
        start_batch=7,
        num_batches=196,
        heartbeat_s=1.0,
        transport="shm",
        shm=ShmRing(name="/shardserve-1234-5", slots=4, slot_bytes=1 << 20),
        group=8,
    ),
    "reject": Reject(
        code=ErrorCode.VERSION_MISMATCH, message="client speaks [9], server speaks [3]", nonce=42
    ),
    "credit": Credit(
        grant=2, slots=(0, 3), stats=ClientStats(batches=10, wait_s=0.5, compute_s=2.0)
    ),
    "end_of_epoch": EndOfEpoch(stream=5, epoch=3, num_batches=196),
    "heartbeat": Heartbeat(stats=ClientStats(batches=1)),
    "error": Error(
        code=ErrorCode.DATASET_CORRUPT, message="shard-00000.arrow: checksum mismatch", stream=5
    ),
    "bye": Bye(),
}

BATCHES = {
    "batch_socket": BatchHeader(
        stream=5,
        epoch=3,
        index=7,
        parts=(
            PartHeader("image", "uint8", (2, 3, 4, 4), 96),
            PartHeader("label", "int64", (2,), 16),
        ),
    ),
    "batch_slot": BatchHeader(
        stream=5,
        epoch=3,
        index=8,
        slot=2,
        count=2,
        rows=1,
        parts=(
            PartHeader("x", "float32", (5,), 20, 0),
            PartHeader("x.offsets", "int64", (3,), 24, 64),
            PartHeader("x.shapes", "int64", (2, 1), 16, 128),
        ),
    ),
}


def header_bytes(name: str) -> bytes:
    if name in CONTROL:
        return encode(CONTROL[name])[0]
    h = BATCHES[name]
    payload = [] if h.slot >= 0 else [bytes(p.nbytes) for p in h.parts]
    return bytes(encode_batch(h, payload)[0])


def names() -> list[str]:
    return [*CONTROL, *BATCHES]


if __name__ == "__main__":
    GOLDEN.mkdir(exist_ok=True)
    for n in names():
        (GOLDEN / f"{n}.bin").write_bytes(header_bytes(n))
        print("wrote", GOLDEN / f"{n}.bin")
