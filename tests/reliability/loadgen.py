"""A many-stream load generator on raw DEALER sockets: one thread, one ``zmq.Poller``.

Used by ``test_load.py`` (small, CI) and ``bench/bench_load.py`` (larger); the code is
``bench/_support.py``'s, whose job waits the test server's ``slowness`` stretches. Each stream is one
(job, rank); the consumer is infinitely fast (every batch's credit goes straight back), and at
``EndOfEpoch`` the stream says Hello for the next epoch on the same socket, so every stream is
busy for the whole run. Batch headers are decoded and checked (stream id, epoch, index order);
payloads are not copied.
"""

from bench._support import LoadResult, StreamLoad, create_jobs, rss_bytes, run_load

__all__ = ["LoadResult", "StreamLoad", "create_jobs", "rss_bytes", "run_load"]
