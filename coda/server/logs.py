"""Structured logs: one JSON object per line with the request id and any ``extra`` fields
(issue 4 item 6), uvicorn's own lines included (issue 14 item 6). Route code logs with
``extra={"request_id": ...}``."""

from __future__ import annotations

import json
import logging
import time

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_STANDARD = frozenset(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {
    "message", "asctime", "taskName", "color_message"}  # NOTE: uvicorn's ANSI copy of msg


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``; exceptions under ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(time.time(), 6), "level": record.levelname, "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | None) \
                    else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "info", *, json_lines: bool = True) -> None:
    """Route the ``coda`` loggers to stderr (JSON lines unless ``json_lines`` is False)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s", defaults={
            "request_id": "-"}))
    root = logging.getLogger("coda")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # NOTE: uvicorn's own lines (startup, errors, access) go the same way; the server passes
    # ``log_config=None`` so uvicorn does not install its plain-text handlers over these.
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
