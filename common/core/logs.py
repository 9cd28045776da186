"""Service logs on stderr: JSON (one object per line, easy to ship to a SIEM) or text
(one readable line per event, for the ML engineer at a terminal).

gRPC's C core writes its own lines straight to file descriptor 2, past Python's
logging. In JSON mode fd 2 is therefore a pipe whose reader thread passes JSON lines
through and wraps every other line (C-core messages, a stray traceback, `medfed:
error:` lines) into a JSON record, so a log shipper never sees a broken line.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import logging
import os
import re
import sys
import threading
from typing import IO, Any

from common.core.errors import ValidationError
from common.core.parsing import parse_json

_STANDARD = set(vars(logging.makeLogRecord({})))
LOG_FORMATS = ("json", "text")

# gRPC C-core line prefix ("E1122 18:19:55.419450 16924 add_port.cc:83] ..."): severity.
_CORE_LINE = re.compile(r"^([DIWEF])\d{4} [\d:.]+\s+\d+ [^\]]+\] ")
_CORE_LEVELS = {"D": "debug", "I": "info", "W": "warning", "E": "error", "F": "critical"}


def quiet_grpc_core() -> None:
    """Before grpc is imported: C-core logs errors only, no tracers (an operator's
    explicit GRPC_VERBOSITY / GRPC_TRACE still wins)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_TRACE", "")


def _timestamp(created: float) -> str:
    return dt.datetime.fromtimestamp(created, dt.UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, sort_keys=False)


class TextFormatter(logging.Formatter):
    """``2025-01-02 10:11:12 INFO    site:a  round number 4 (training; ...) done: ...``
    (local time; the structured fields stay in the JSON format)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        when = dt.datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M:%S")
        line = f"{when} {record.levelname:<7} {self.service}  {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonStderr:
    """fd 2 -> pipe -> reader thread -> the original stderr, every line as JSON."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.lock = threading.Lock()
        sys.stderr.flush()
        self.original_fd = os.dup(2)
        self.out: IO[str] = os.fdopen(os.dup(self.original_fd), "w", buffering=1,
                                      encoding="utf-8", errors="replace")
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="medfed-stderr-json", daemon=True
        )
        self.thread.start()
        atexit.register(self.close)

    def write_line(self, line: str) -> None:
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()

    def wrap(self, text: str) -> str:
        """`text` unchanged if it is a JSON object, else a JSON record holding it."""
        if text.startswith("{"):
            try:
                if isinstance(parse_json(text), dict):
                    return text
            except ValidationError:
                pass
        core = _CORE_LINE.match(text)
        entry = {
            "ts": _timestamp(dt.datetime.now(dt.UTC).timestamp()),
            "level": _CORE_LEVELS[core.group(1)] if core else (
                "error" if text.startswith(("medfed: error", "Traceback")) else "info"
            ),
            "service": self.service,
            "logger": "grpc.core" if core else "stderr",
            "msg": text,
        }
        return json.dumps(entry)

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if text.strip():
                    self.write_line(self.wrap(text))

    def close(self) -> None:
        """Restore fd 2 and drain what was written before (at exit)."""
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self.original_fd, 2)  # the pipe's last write end closes: EOF
        self.thread.join(timeout=2.0)


class _LineHandler(logging.Handler):
    def __init__(self, sink: _JsonStderr) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write_line(self.format(record))
        except Exception:  # logging's contract: a failing handler reports, never raises
            self.handleError(record)


_json_stderr: _JsonStderr | None = None


def configure_logging(service: str, level: str = "info", fmt: str = "json") -> None:
    """Root logging for a service; `fmt` is "json" or "text" (see the module doc)."""
    global _json_stderr
    handler: logging.Handler
    if fmt == "text":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TextFormatter(service))
    elif fmt == "json":
        if _json_stderr is None:
            _json_stderr = _JsonStderr(service)
        handler = _LineHandler(_json_stderr)
        handler.setFormatter(JsonFormatter(service))
    else:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {fmt!r}")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)
