"""Streaming processes: a sidecar's streams spread over worker processes beside the main one
(``--stream-processes``; see ``docs/concepts/streaming-processes.md``).

``link``: the typed pipe between the two; ``replica``, ``feed`` and ``child``: a streaming
process; ``placement``, ``counters`` and ``parent``: what the main process keeps of them.
"""
