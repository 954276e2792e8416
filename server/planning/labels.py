"""Bucket labels of the bucket shuffle, drawn as ``Generator.integers`` draws them, sooner.

``rng.integers(0, k, size=n, dtype=np.uint8)`` takes one byte at a time from the generator's
32-bit outputs (low byte first) and, unless ``k`` is 256, maps byte ``x`` to ``x * k >> 8``,
rejecting it when ``x * k & 0xFF`` is below ``(256 - k) % k`` (Lemire's method). numpy does
that byte by byte in C (~9 ns a label for ``k = 115``); :func:`bucket_labels` does the same
on blocks of raw 64-bit outputs with numpy operations and leaves the generator in exactly the
state ``integers`` would have (the plans depend on every later draw), so it is a faster
spelling of the same draws. A ``PCG64`` generator is needed to rewind and set that state;
any other falls back to ``integers``. tests/planning/test_labels.py checks the identity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Raw 64-bit outputs turned into labels at once: temporaries of a few MB (~5 MB at 2**17,
#: which a mixture's planner may need twice at once, one a thread).
BLOCK_WORDS = 1 << 17


def bucket_labels(
    rng: np.random.Generator, n: int, k: int, *, block_words: int = BLOCK_WORDS
) -> np.ndarray:
    """``rng.integers(0, k, size=n, dtype=np.uint8)``, the same labels and the same state
    after, for ``2 <= k <= 256``; ``block_words``: raw outputs turned into labels at once.

    >>> a, b = np.random.default_rng(1), np.random.default_rng(1)
    >>> bool((bucket_labels(a, 1000, 115) == b.integers(0, 115, 1000, dtype=np.uint8)).all())
    True
    >>> a.bit_generator.state == b.bit_generator.state
    True
    """
    bitgen = rng.bit_generator
    # k = 256 keeps every byte: numpy's own loop is a copy, as fast as any.
    if not isinstance(bitgen, np.random.PCG64) or not 2 <= k < 256 or n <= 0:
        return rng.integers(0, k, size=n, dtype=np.uint8)
    start = bitgen.state
    # The 32-bit output PCG64 holds back from its last 64-bit one comes first.
    held = int(start["has_uint32"])
    lead = np.array([start["uinteger"]] if held else [], dtype="<u4").view(np.uint8)
    threshold = np.uint8((256 - k) % k)
    per_word = 8 * (256 - int(threshold)) / 256  # labels a raw output gives, on average
    out = np.empty(n, dtype=np.uint8)
    got = words = used = 0  # labels written; raw outputs drawn; bytes consumed (held incl.)
    last = np.zeros(0, dtype="<u8")
    while got < n:
        first_byte = 0 if words == 0 else len(lead) + 8 * words
        size = min(block_words, int((n - got) / per_word) + 64)
        last = bitgen.random_raw(size).astype("<u8", copy=False)
        raw = np.concatenate((lead, last.view(np.uint8))) if words == 0 else last.view(np.uint8)
        words += len(last)
        scaled = raw.astype("<u2")
        scaled *= np.uint16(k)
        low_high = scaled.view(np.uint8)  # little-endian: the low byte of each first
        keep = low_high[0::2] >= threshold
        labels = low_high[1::2][keep]
        take = min(n - got, len(labels))
        out[got : got + take] = labels[:take]
        got += take
        if got == n:
            used = first_byte + _nth_true(keep, take) + 1
    _rewind(bitgen, start, held, used, last, words)
    return out


def _nth_true(mask: np.ndarray, nth: int) -> int:
    """Index of the ``nth`` (from 1) ``True`` of ``mask``, which has at least that many:
    counted span by span, never a list of every index. Each span is as long as the Trues
    still missing, so it never passes the answer, and the few rejected bytes left over take
    a few more spans.

    >>> _nth_true(np.array([True, False, False, True, True]), 2)
    3
    """
    end = seen = 0
    while seen < nth:
        start, end = end, end + nth - seen
        seen += int(np.count_nonzero(mask[start:end]))
    return end - 1


def _rewind(
    bitgen: np.random.PCG64,
    start: Any,  # the state dict PCG64 had before the draws
    held: int,
    used: int,
    last: np.ndarray,
    words: int,
) -> None:
    """Put ``bitgen`` where ``integers`` leaves it: every 32-bit output a consumed byte came
    from is used up (the rest of the last one is dropped), and the high half of a 64-bit
    output whose low half was the last one used is held back."""
    outputs = -(-used // 4) - held  # 32-bit outputs taken from fresh 64-bit ones
    raw = max(-(-outputs // 2), 0)
    bitgen.state = start
    state = bitgen.advance(raw).state if raw else bitgen.state
    if outputs > 0:
        # The last word drawn is ``words - 1``; the last one used, ``raw - 1``, lies in the
        # final block (it holds the byte that made the ``n``-th label). numpy keeps its high
        # half whether or not it is still held.
        word = int(last[raw - 1 - (words - len(last))])
        state["has_uint32"], state["uinteger"] = outputs % 2, word >> 32
    else:  # only the held output was used
        state["has_uint32"], state["uinteger"] = 0, start["uinteger"]
    bitgen.state = state
