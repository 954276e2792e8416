"""The control plane as the client sees it: a few small HTTP calls through httpx.

Every call has a timeout; a 4xx/5xx body (``{"code", "detail"}``) becomes the matching
exception from :mod:`shardserve.proto.errors`, and an unreachable server becomes
:class:`ServerUnavailable` naming the URL.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import httpx
import numpy as np

from shardserve.proto.api import (
    CreatedJob,
    DatasetInfo,
    JobStatus,
    MixtureStatus,
    MixtureUpdate,
    QuarantineList,
    QuarantineRequest,
    ServerInfo,
)
from shardserve.proto.endpoints import reaches_this_host
from shardserve.proto.errors import (
    BadRequest,
    ServerUnavailable,
    ShardserveError,
    error_for_code,
)
from shardserve.proto.jobs import (
    JobSpec,
)
from shardserve.proto.processes import Placement, PlaceRequest

#: Header of ``GET /v1/jobs/{id}/plan``: how many batches the ids are cut into.
PLAN_BATCHES_HEADER = "X-Shardserve-Num-Batches"
#: Header of ``GET /v1/jobs/{id}/plan``: the offset the plan was dealt from (elastic resume).
PLAN_OFFSET_HEADER = "X-Shardserve-Offset"
#: Where a Loader whose ``url`` is ``None`` looks without ``SHARDSERVE_URL``: the node-local
#: sidecar.
DEFAULT_URL = "http://127.0.0.1:7070"


class ControlClient:
    """Blocking calls to ``/v1/...`` with a per-call deadline.

    >>> with ControlClient("http://127.0.0.1:7070") as api:   # doctest: +SKIP
    ...     api.info().data_endpoints
    ['tcp://127.0.0.1:7071', 'ipc:///tmp/ss.sock']
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 10.0,
        connect_retry_s: float = 0.0,
    ) -> None:
        """``connect_retry_s``: for how long a refused connection (a server restarting, not yet
        listening) is retried before :class:`ServerUnavailable`; 0 means not at all."""
        self.url = url.rstrip("/")
        self.connect_retry_s = connect_retry_s
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadRequest(f"server URL {url!r} must look like http://HOST:PORT")
        self.host = parts.hostname
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # A proxy from the environment must not swallow loopback traffic to our own sidecar.
        # Plain http needs no certificates, and loading them costs ~25 ms of construction time.
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            trust_env=not reaches_this_host(self.host),
            verify=parts.scheme == "https",
        )

    def _request(
        self, method: str, path: str, timeout: float | None = None, **kw: object
    ) -> httpx.Response:
        deadline = time.monotonic() + self.connect_retry_s
        delay = 0.05
        while True:
            try:
                r = self._http.request(method, path, timeout=timeout or self._http.timeout, **kw)  # type: ignore[arg-type]
                break
            except httpx.ConnectError as e:
                if _tls_failed(e):  # not a server that is down: retrying cannot help
                    raise ServerUnavailable(
                        f"control plane {self.url}: the TLS handshake failed ({e}); a shardserve "
                        "server speaks plain HTTP: use an http:// URL, unless a TLS proxy "
                        "fronts it"
                    ) from None
                # Nothing was sent, so any call (all are idempotent) may be tried again.
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = (
                        f" for {self.connect_retry_s:.1f} s" if self.connect_retry_s > 0 else ""
                    )
                    raise ServerUnavailable(
                        f"control plane {self.url} refused {method} {path}{waited} (is the "
                        f"server running, or still restarting?): {type(e).__name__}: {e}"
                    ) from None
                time.sleep(min(delay, left))  # backoff between connection attempts
                delay = min(delay * 2, 1.0)
            except httpx.HTTPError as e:
                raise ServerUnavailable(
                    f"control plane {self.url} did not answer {method} {path}: {type(e).__name__}: {e}"
                ) from None
        if r.status_code >= 400:
            raise _error_from(r, f"{method} {path}")
        return r

    def info(self) -> ServerInfo:
        return ServerInfo.model_validate_json(self._request("GET", "/v1/info").content)

    def create_job(self, spec: JobSpec, timeout: float | None = None) -> CreatedJob:
        """``POST /v1/jobs``: idempotent, every rank may post the same spec."""
        # Fields added later only when set: a server from before them still takes the spec.
        later = (
            ("collate", spec.collate),
            ("mixture", spec.mixture),
            ("epoch_samples", spec.epoch_samples),
            ("schedule", spec.schedule),
            ("share", spec.share),
        )
        unset = {k for k, v in later if v is None}
        if spec.env_shuffle == "independent":
            unset.add("env_shuffle")
        body = spec.model_dump(mode="json", exclude=unset or None)
        return CreatedJob.model_validate_json(
            self._request("POST", "/v1/jobs", json=body, timeout=timeout).content
        )

    def dataset(self, name: str, timeout: float | None = None) -> DatasetInfo:
        """``GET /v1/datasets/{name}``: its fields and the tree of a nested sample."""
        return DatasetInfo.model_validate_json(
            self._request("GET", f"/v1/datasets/{name}", timeout=timeout).content
        )

    def job(self, job_id: str, timeout: float | None = None) -> JobStatus:
        return JobStatus.model_validate_json(
            self._request("GET", f"/v1/jobs/{job_id}", timeout=timeout).content
        )

    def plan(
        self,
        job_id: str,
        epoch: int,
        rank: int,
        env: int | None = None,
        timeout: float | None = None,
        offset: int = 0,
    ) -> tuple[np.ndarray, int]:
        """``GET /v1/jobs/{id}/plan``: ``rank``'s sample ids of ``epoch`` in batch order (int64)
        and the number of batches they make, exactly as the data plane would stream them
        (``env``: that environment's own ids; ``None``: the job's steps as streamed);
        ``offset``: the plan dealt from there (an elastic resume, see ``proto.resume``)."""
        params = {"epoch": epoch, "rank": rank} | ({} if env is None else {"env": env})
        if offset:
            params["offset"] = offset
        r = self._request("GET", f"/v1/jobs/{job_id}/plan", params=params, timeout=timeout)
        if offset and r.headers.get(PLAN_OFFSET_HEADER) != str(offset):
            raise ShardserveError(
                f"GET /v1/jobs/{job_id}/plan: asked for the plan dealt from offset {offset}, "
                f"the server answered {PLAN_OFFSET_HEADER}={r.headers.get(PLAN_OFFSET_HEADER)!r}; "
                "an elastic resume needs a server that has it (upgrade the server)"
            )
        try:
            batches = int(r.headers[PLAN_BATCHES_HEADER])
        except (KeyError, ValueError):
            raise ShardserveError(
                f"GET /v1/jobs/{job_id}/plan: response lacks {PLAN_BATCHES_HEADER}; "
                "is the server older than this client?"
            ) from None
        if len(r.content) % 8:
            raise ShardserveError(
                f"GET /v1/jobs/{job_id}/plan: {len(r.content)} bytes is not a whole number of int64 ids"
            )
        return np.frombuffer(r.content, dtype="<i8"), batches

    def mixture(self, job_id: str, timeout: float | None = None) -> MixtureStatus:
        """``GET /v1/jobs/{id}/mixture``: sources, schedule, weights in force, frontier."""
        r = self._request("GET", f"/v1/jobs/{job_id}/mixture", timeout=timeout)
        return MixtureStatus.model_validate_json(r.content)

    def set_mixture(
        self,
        job_id: str,
        weights: Mapping[str, float] | Sequence[float],
        at_step: int | None = None,
        timeout: float | None = None,
    ) -> MixtureStatus:
        """``PUT /v1/jobs/{id}/mixture``: ``weights`` from global step ``at_step`` on (``None``:
        the server's frontier); ``StepInThePast`` if a rank was already sent that step."""
        body = MixtureUpdate(
            weights=dict(weights) if isinstance(weights, Mapping) else list(weights),
            at_step=at_step,
        ).model_dump(mode="json")
        r = self._request("PUT", f"/v1/jobs/{job_id}/mixture", json=body, timeout=timeout)
        return MixtureStatus.model_validate_json(r.content)

    def place(self, job_id: str, req: PlaceRequest, timeout: float | None = None) -> Placement:
        """``POST /v1/jobs/{id}/place``: the process to say ``req``'s Hello to."""
        body = req.model_dump(mode="json")
        r = self._request("POST", f"/v1/jobs/{job_id}/place", json=body, timeout=timeout)
        return Placement.model_validate_json(r.content)

    def quarantine(
        self, dataset: str, ids: Sequence[int], reason: str, timeout: float | None = None
    ) -> QuarantineList:
        """``POST /v1/datasets/{name}/quarantine``: no plan deals these ids any more, from
        each reading job's frontier on."""
        body = QuarantineRequest(ids=list(ids), reason=reason).model_dump(mode="json")
        r = self._request("POST", f"/v1/datasets/{dataset}/quarantine", json=body, timeout=timeout)
        return QuarantineList.model_validate_json(r.content)

    def quarantined(self, dataset: str, timeout: float | None = None) -> QuarantineList:
        """``GET /v1/datasets/{name}/quarantine``: the dataset's quarantined ids, why, and
        from which step each job skips them."""
        r = self._request("GET", f"/v1/datasets/{dataset}/quarantine", timeout=timeout)
        return QuarantineList.model_validate_json(r.content)

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether ``GET /healthz`` answers 2xx within ``timeout``; never raises."""
        try:
            return self._http.get("/healthz", timeout=timeout).status_code < 300
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_url(url: str | None) -> str:
    """``url``, else ``SHARDSERVE_URL``, else :data:`DEFAULT_URL` (this node's sidecar)."""
    return url or os.environ.get("SHARDSERVE_URL") or DEFAULT_URL


def _tls_failed(e: BaseException) -> bool:
    """Whether ``e`` (httpx's, which wraps httpcore's) came from a TLS handshake."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def server_token(token: str | None) -> str | None:
    """``token``, else ``SHARDSERVE_TOKEN``, else none; ``BadRequest`` for one with whitespace
    at either end (the newline of a secret file), which no HTTP header may carry."""
    found = token or os.environ.get("SHARDSERVE_TOKEN") or None
    if found is not None and found != found.strip():
        where = "token" if token else "SHARDSERVE_TOKEN"
        # Never the secret itself in the message.
        raise BadRequest(
            f"{where} has whitespace at its start or end (the newline of the file it was read "
            "from?): strip it"
        )
    return found


def _error_from(r: httpx.Response, what: str) -> ShardserveError:
    try:
        body = r.json()
        code, detail = str(body["code"]), str(body["detail"])
    except (ValueError, KeyError, TypeError):
        code, detail = ("internal" if r.status_code >= 500 else "bad_request"), r.text[:500]
    if r.status_code == 404 and code in ("not_found", "bad_request"):  # a route, not a dataset
        detail += (
            f" (no route {r.request.url.path}: give the server's base URL, such as "
            "http://127.0.0.1:7070, with no path after it)"
        )
    if r.status_code == 401 or r.status_code == 403:
        code = code if code != "internal" else "unauthorized"
    return error_for_code(code, f"{what} -> HTTP {r.status_code}: {detail}")
