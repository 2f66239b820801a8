"""Log lines for humans (text) or for log pipelines (one JSON object per line).

Both formats carry the request context: a line logged while a request is
being handled (its Generate call's task, see gateway/observability.py) names
the request id and the trace id. The trace id comes from the current span
when tracing is on, else from the traceparent the client sent, so the logs
of a request can be joined with the caller's trace even when this mesh does
not export traces.

JSON fields: ts (RFC 3339, UTC, milliseconds), level, role, member, logger,
msg, and when known request_id, trace_id, span_id; exc (the traceback) for
a logged exception.
"""

import contextvars
import dataclasses
import datetime
import json
import logging

from opentelemetry import trace

LOG_FORMATS = ("text", "json")


@dataclasses.dataclass(slots=True)
class RequestLogContext:
    """What every log line about one request carries."""

    request_id: str = ""
    trace_id: str = ""


# Set for the duration of a request's handler (its task and what it calls).
REQUEST_CONTEXT: contextvars.ContextVar[RequestLogContext | None] = contextvars.ContextVar(
    "moemesh_request_log_context", default=None)


class RequestContextFilter(logging.Filter):
    """Adds request_id, trace_id and span_id attributes to every record ("" if unknown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = REQUEST_CONTEXT.get()
        record.request_id = request.request_id if request else ""
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            record.trace_id = format(span_context.trace_id, "032x")
            record.span_id = format(span_context.span_id, "016x")
        else:
            record.trace_id = request.trace_id if request else ""
            record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def __init__(self, role: str, member_id: str):
        super().__init__()
        self._role = role
        self._member_id = member_id

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "role": self._role,
            "member": self._member_id,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The human format: time, level, role[member], logger, message, then
    [request=... trace=...] when the line is about a request."""

    def __init__(self, role: str, member_id: str):
        super().__init__(f"%(asctime)s %(levelname)s {role}[{member_id}] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", "")
        if request_id:
            trace_id = getattr(record, "trace_id", "")
            text += f" [request={request_id}{' trace=' + trace_id if trace_id else ''}]"
        return text


def configure(role: str, member_id: str, level: str, log_format: str = "text") -> None:
    """Logs to stderr in log_format ("text" or "json") at level."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestContextFilter())
    formatter = JsonFormatter if log_format == "json" else TextFormatter
    handler.setFormatter(formatter(role, member_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
