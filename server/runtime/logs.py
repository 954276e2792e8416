"""One log line per event, with the job, rank and stream it concerns.

Call sites say *what happened* and attach facts as keywords::

    log_event(log, "stream.opened", job=job_id, rank=0, stream=7, epoch=3)

``text`` format (default, for people)::

    2024-05-01T12:00:00.123Z INFO shardserve.streaming stream.opened job=ab12 rank=0 stream=7 epoch=3

``json`` format (for log shippers): one object per line with ``ts``, ``level``, ``logger``,
``event`` and the facts as top-level keys. Records from other libraries (uvicorn) go through
the same formatter, with their message as ``event``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_FIELDS_ATTR = "shardserve_fields"
_HANDLER_NAME = "shardserve"


def log_event(
    logger: logging.Logger,
    event: str,
    *,
    level: int = logging.INFO,
    exc_info: bool = False,
    **fields: object,
) -> None:
    """Log ``event`` with ``fields`` (job, rank, stream, ...) as one line."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={_FIELDS_ATTR: fields}, exc_info=exc_info)


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """``TS LEVEL logger event k=v k=v``: greppable, one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = getattr(record, _FIELDS_ATTR, {})
        kv = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        msg = _one_line(record.getMessage())
        line = f"{_timestamp(record)} {record.levelname} {record.name} {msg}"
        if kv:
            line += " " + kv
        if record.exc_info:
            # Keep the traceback on the same logical record but escaped onto one line.
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


#: A value shown bare: printable ASCII other than space, ``"``, ``=`` and ``\\``. Anything else
#: (a peer's job id with a newline, say) is JSON-quoted, so one record stays one line that
#: cannot forge another record or another ``k=v``.
_BARE = re.compile(r"[!#-<>-\[\]-~]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _text_value(v: object) -> str:
    s = str(v)
    return s if _BARE.fullmatch(s) else json.dumps(s)


def _one_line(msg: str) -> str:
    """``msg`` with control characters escaped (other libraries' messages may carry a peer's
    bytes, e.g. a request path)."""
    return _CONTROL.sub(lambda m: json.dumps(m.group())[1:-1], msg)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        for k, v in getattr(record, _FIELDS_ATTR, {}).items():
            obj.setdefault(k, v)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    """Send every log record to stderr in ``fmt``; called once by the entry point.

    Replaces a handler this function installed before (so tests may call it twice) and
    leaves handlers that others installed alone.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
