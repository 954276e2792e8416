"""Both batch sinks without a server: real ZeroMQ sockets over inproc, a real shm ring."""

from __future__ import annotations

import gc
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from shardserve.proto.framing import decode_batch
from shardserve.server.runtime.rings import DEFAULT_DIR, ShmUnavailable
from shardserve.server.store.catalog import Store
from shardserve.server.store.read.dataset import Dataset
from shardserve.server.streaming.sinks import IdlePools, RingBook, Route, SlotSink, SocketSink
from tests.support.data import make_cifar_like, sample_id_of

FIELDS = ("image", "label")
BATCH = 8
PEER = b"peer-1"


@pytest.fixture(scope="module")
def cifar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dataset]:
    root = tmp_path_factory.mktemp("store")
    make_cifar_like(root, "cifar", n=64)
    ds = Store(root).open("cifar")
    yield ds


@pytest.fixture()
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER (the server's side) and a connected DEALER with a known routing id."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    dealer.setsockopt(zmq.IDENTITY, PEER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
    router.bind("inproc://sinks")
    dealer.connect("inproc://sinks")
    dealer.send(b"hi")  # the ROUTER learns the peer's routing id
    assert router.recv_multipart() == [PEER, b"hi"]
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def _gather(ds: Dataset, sink: SocketSink | SlotSink, ticket: int, start: int) -> dict:
    out = sink.out(ticket, BATCH)
    parts = ds.take(np.arange(start, start + BATCH), FIELDS, out=out)
    place = sink.placer(ticket)
    return place(parts) if place is not None else parts


def test_socket_sink_sends_zero_copy_and_reuses_a_set_once_sent(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    """A batch gathered into a pooled set arrives byte for byte; the set is reused only after
    zmq is done with it, and a released (never sent) set is reused at once."""
    router, dealer = pair
    pool = IdlePools().get(("job", 0), cifar.part_shapes(FIELDS), BATCH, live={("job", 0)})
    sink = SocketSink(Route(router, PEER, stream=7, epoch=2), pool)
    ticket = sink.acquire()
    out = sink.out(ticket, BATCH)
    assert out is not None and out["image"].shape == (BATCH, 3, 32, 32)
    parts = _gather(cifar, sink, ticket, 16)
    assert np.shares_memory(parts["image"], out["image"])  # gathered in place, not copied
    assert sink.send(ticket, 5, parts) == sum(a.nbytes for a in parts.values())
    header, payload = decode_batch(dealer.recv_multipart())
    assert (header.stream, header.epoch, header.index, header.slot) == (7, 2, 5, -1)
    got = np.frombuffer(payload[0], dtype=np.uint8).reshape(BATCH, 3, 32, 32)
    assert sample_id_of({"image": got}).tolist() == list(range(16, 24))
    assert sink.overflowed == 0

    def image_of(ticket: int) -> np.ndarray:
        arrays = sink.out(ticket, BATCH)
        assert arrays is not None
        return arrays["image"]

    again = sink.acquire()
    assert np.shares_memory(image_of(again), out["image"])  # the sent set came back
    sink.release(again)
    third = sink.acquire()
    assert np.shares_memory(image_of(third), out["image"])
    other = sink.acquire()  # the pool's one set is out: a second set is made
    assert not np.shares_memory(image_of(other), out["image"])


def test_socket_sink_keeps_a_batch_the_peer_cannot_take(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    """A send to a vanished peer raises EHOSTUNREACH and leaves the ticket held, so the
    caller decides (close the stream) and the set is released exactly once."""
    router, _ = pair
    pool = IdlePools().get(("job", 0), cifar.part_shapes(FIELDS), BATCH, live=set())
    sink = SocketSink(Route(router, b"nobody", stream=1, epoch=0), pool)
    ticket = sink.acquire()
    parts = _gather(cifar, sink, ticket, 0)
    with pytest.raises(zmq.ZMQError) as e:
        sink.send(ticket, 0, parts)
    assert e.value.errno == zmq.EHOSTUNREACH
    assert sink.out(ticket, BATCH) is not None  # still held
    sink.release(ticket)
    assert sink.out(ticket, BATCH) is None


def test_idle_pools_drop_least_recently_used_idle_pools_past_the_budget(cifar: Dataset) -> None:
    """Past the byte budget, idle pools go oldest first; live ones stay whatever their size."""
    shapes = cifar.part_shapes(FIELDS)
    pools = IdlePools(max_idle_bytes=1)
    a = pools.get(("j", 0), shapes, BATCH, live=set())
    a.acquire()  # allocate: the pool now holds bytes
    b = pools.get(("j", 1), shapes, BATCH, live={("j", 0)})
    b.acquire()
    assert pools.get(("j", 0), shapes, BATCH, live={("j", 0)}) is a  # live: kept
    c = pools.get(("j", 2), shapes, BATCH, live={("j", 0)})
    assert c is not b and pools.get(("j", 1), shapes, BATCH, live=set()) is not b  # dropped
    pools.forget_job("j")
    assert pools.nbytes == 0


@pytest.fixture()
def book() -> Iterator[RingBook]:
    book = RingBook(DEFAULT_DIR, limit_bytes=None)
    yield book
    book.close()


def _read_slot(path: Path, sink: SlotSink, slot: int, offset: int, nbytes: int) -> bytes:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        start = slot * sink.slots.ring.slot_bytes + offset
        return bytes(mm[start : start + nbytes])


def test_slot_sink_lends_slots_and_takes_them_back(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket], book: RingBook
) -> None:
    """The ring holds exactly the credit; a sent slot is lent until a Credit returns it; the
    socket carries only the slot number and the bytes are in the ring."""
    router, dealer = pair
    sink = book.open(Route(router, PEER, 3, 1), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    try:
        assert sink.transport == "shm" and sink.ring.slots == 2
        first, second = sink.acquire(), sink.acquire()
        assert first is not None and second is not None and sink.acquire() is None
        parts = _gather(cifar, sink, first, 40)
        sink.send(first, 0, parts)
        frames = dealer.recv_multipart()
        header, payload = decode_batch(frames)
        assert header.slot == first and payload == [] and len(frames) == 1
        image = next(p for p in header.parts if p.name == "image")
        raw = _read_slot(sink.slots.ring.path, sink, first, image.offset, image.nbytes)
        got = np.frombuffer(raw, dtype=np.uint8).reshape(BATCH, 3, 32, 32)
        assert sample_id_of({"image": got}).tolist() == list(range(40, 48))

        sink.release(second)  # never sent: free again at once
        assert sink.acquire() == second
        assert sink.acquire() is None  # the first is with the client
        assert sink.returned([first]) == []
        assert sink.returned([first, 99]) == [first, 99]  # not held any more: ignored
        assert sink.acquire() == first
    finally:
        sink.close()
    assert not sink.slots.ring.path.exists()


def test_a_peer_next_stream_takes_its_ring_over_when_the_layout_fits(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket], book: RingBook
) -> None:
    """Handed over, a ring is reused by the same peer's next stream (slots it still reads
    stay lent); another layout gets a new ring and the old one is unlinked."""
    router, _ = pair
    old = book.open(Route(router, PEER, 1, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    lent = old.acquire()
    assert lent is not None
    old.slots.lend(lent)
    old.close(handover=True)
    path = old.slots.ring.path
    assert path.exists()
    new = book.open(
        Route(router, PEER, 2, 1),
        2,
        cifar,
        FIELDS,
        BATCH,
        keep=(lent,),
        keep_ring=old.slots.ring.name,
    )
    assert new.slots is old.slots and new.route.stream == 2
    assert new.acquire() is not None and new.acquire() is None  # the kept slot is not free
    assert new.returned([lent]) == []
    new.close(handover=True)
    bigger = book.open(Route(router, PEER, 3, 2), 3, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    try:
        assert bigger.slots is not old.slots and not path.exists()
    finally:
        bigger.close()
    book.discard(PEER)


def test_a_keep_of_another_ring_or_of_unlent_slots_keeps_nothing(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket], book: RingBook
) -> None:
    """A Hello whose keep names another ring (the client still reads a restarted server's ring,
    or never saw this one's Welcome) or slots this ring never lent leaves every slot free:
    honouring it would leave the stream without a slot to fill, heartbeating forever."""
    router, _ = pair
    first = book.open(Route(router, PEER, 1, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    lent = first.acquire()
    assert lent is not None
    first.slots.lend(lent)
    first.close(handover=True)
    name = first.slots.ring.name
    stale = book.open(
        Route(router, PEER, 2, 1), 2, cifar, FIELDS, BATCH, keep=(0, 1), keep_ring="ss-gone-ring"
    )
    assert stale.slots is first.slots
    assert stale.acquire() is not None and stale.acquire() is not None
    stale.close(handover=True)  # nothing lent now
    unlent = book.open(
        Route(router, PEER, 3, 2), 2, cifar, FIELDS, BATCH, keep=(0, 1), keep_ring=name
    )
    try:
        assert unlent.acquire() is not None and unlent.acquire() is not None
    finally:
        unlent.close()


def test_rings_share_one_limit(cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    """The limit counts every live ring: a second ring that would pass it is refused with the
    flag to change, and fits again once the first is closed."""
    router, _ = pair
    probe = RingBook(DEFAULT_DIR, None).open(
        Route(router, b"a", 1, 0), 2, cifar, FIELDS, BATCH, (), ""
    )
    size = probe.slots.ring.nbytes
    probe.close()
    book = RingBook(DEFAULT_DIR, limit_bytes=size + size // 2)
    first = book.open(Route(router, b"a", 1, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    first.mapped()  # its client's first Credit: from now on the ring counts
    with pytest.raises(ShmUnavailable, match="--shm-limit-bytes"):
        book.open(Route(router, b"b", 2, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    first.close()
    second = book.open(Route(router, b"b", 2, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
    second.mapped()
    assert book.live_bytes == size
    second.close()
    assert book.live_bytes == 0
    gc.collect()


def test_unmapped_rings_do_not_count_against_the_limit_but_are_capped(
    cifar: Dataset, pair: tuple[zmq.Socket, zmq.Socket]
) -> None:
    """Rings whose client never proved it mapped them leave the limit to proven rings, and at
    most ``max_unproven`` of them exist at once; proof (a Credit) frees a place."""
    router, _ = pair
    probe = RingBook(DEFAULT_DIR, None).open(
        Route(router, b"a", 1, 0), 2, cifar, FIELDS, BATCH, (), ""
    )
    size = probe.slots.ring.nbytes
    probe.close()
    book = RingBook(DEFAULT_DIR, limit_bytes=size, max_unproven=1)
    try:
        ghost = book.open(
            Route(router, b"ghost", 1, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring=""
        )
        assert book.live_bytes == 0 and book.unproven == 1
        with pytest.raises(ShmUnavailable, match="--shm-unproven-rings"):
            book.open(Route(router, b"real", 2, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring="")
        ghost.close()  # its stream ended (never mapped): the place is free again
        real = book.open(
            Route(router, b"real", 2, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring=""
        )
        real.mapped()
        assert book.live_bytes == size and book.unproven == 0
        # A new ring must still fit beside the proven ones.
        with pytest.raises(ShmUnavailable, match="--shm-limit-bytes"):
            book.open(
                Route(router, b"ghost2", 3, 0), 2, cifar, FIELDS, BATCH, keep=(), keep_ring=""
            )
        real.close()
    finally:
        book.close()
