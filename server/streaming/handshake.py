"""Deciding a ``Hello``: the checks a stream must pass before the server commits to it.

Pure decision, no socket: :func:`check_hello` returns the reply that refuses the stream, or
``None`` when the stream may open. Order matters and is part of the contract:

1. protocol version   -> ``Reject(VERSION_MISMATCH)`` naming both sides' versions
2. token              -> ``Reject(UNAUTHORIZED)`` (constant-time comparison)
3. job known          -> ``Error(JOB_NOT_FOUND, fatal=False)``: the client re-POSTs its
                         spec (job ids are hashes of specs) and says Hello again
4. job not failed     -> ``Error(<the failure's code>, reason, fatal=True)``
5. rank, offset, start batch -> ``Reject(BAD_REQUEST)`` with the bound in the message
   (``offset``: an elastic resume's deal, see :mod:`shardserve.proto.resume`)
"""

from __future__ import annotations

import hmac

from shardserve.proto.errors import ErrorCode
from shardserve.proto.messages import PROTOCOL_VERSION, SUPPORTED_PROTOCOLS, Error, Hello, Reject

from ..planning import num_batches
from ..registry.jobs import Job


def version_reject(client_versions: list[int] | tuple[int, ...], nonce: int = 0) -> Reject:
    return Reject(
        code=ErrorCode.VERSION_MISMATCH,
        message=(
            f"client speaks protocol version(s) {list(client_versions)}, this server speaks "
            f"{list(SUPPORTED_PROTOCOLS)}: install matching shardserve versions on both sides"
        ),
        nonce=nonce,
    )


def token_ok(expected: str | None, given: str) -> bool:
    """Whether ``given`` matches the server's token (always true without one)."""
    if not expected:
        return True
    return hmac.compare_digest(given.encode(), expected.encode())


def batches_per_rank(job: Job, offset: int = 0) -> int:
    """Batches of each rank's plan dealt from ``offset`` (0: the whole epoch)."""
    s = job.spec
    rest = job.num_samples - offset
    return num_batches(rest, s.deal_world, s.env_batch, s.drop_last)


def offset_bound(job: Job) -> int:
    """One more than the largest ``Hello.offset`` of ``job``: below one batch of every rank
    (the canonical form of a resume point) and within the epoch."""
    s = job.spec
    return min(s.env_batch * s.deal_world, job.num_samples + 1)


def check_hello(hello: Hello, job: Job | None, token: str | None) -> Reject | Error | None:
    """The refusal for ``hello``, or ``None`` to open the stream."""
    if PROTOCOL_VERSION not in hello.protocols:
        return version_reject(hello.protocols, hello.nonce)
    if not token_ok(token, hello.token):
        what = "no token" if not hello.token else "a wrong token"
        return Reject(
            code=ErrorCode.UNAUTHORIZED,
            nonce=hello.nonce,
            message=f"the Hello carried {what}; pass the server's token (--token / SHARDSERVE_TOKEN)",
        )
    if job is None:
        return Error(
            code=ErrorCode.JOB_NOT_FOUND,
            fatal=False,
            message=f"no job {hello.job!r} on this server (it restarted or the job was never "
            "created): POST /v1/jobs with its spec, then say Hello again",
        )
    if job.state == "failed":
        return Error(
            code=job.error_code or ErrorCode.JOB_FAILED,
            fatal=True,
            message=job.error or f"job {job.id} failed",
        )
    ws = job.spec.world_size
    if hello.rank >= ws:
        return Reject(
            code=ErrorCode.BAD_REQUEST,
            nonce=hello.nonce,
            message=f"rank {hello.rank} out of range 0 <= rank < {ws} (world_size of job {job.id})",
        )
    bound = offset_bound(job)
    if hello.offset >= bound:
        return Reject(
            code=ErrorCode.BAD_REQUEST,
            nonce=hello.nonce,
            message=f"offset {hello.offset} out of range 0 <= offset < {bound} (one batch of "
            f"every rank, within the {job.num_samples} samples of job {job.id})",
        )
    nb = batches_per_rank(job, hello.offset)
    if hello.start_batch > nb:
        return Reject(
            code=ErrorCode.BAD_REQUEST,
            nonce=hello.nonce,
            message=f"start_batch {hello.start_batch} out of range 0 <= start_batch <= "
            f"{nb} (batches per rank of job {job.id})",
        )
    return None
