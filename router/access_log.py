"""One access-log line per proxied request, at the router's default log level.

vLLM's and nginx's servers log every request; the router's own log used to hold only its header
lines after hundreds of requests, 404s, 502s and broken streams (issue 32). Each request the
router answers (served, refused, failed, or left by its client) ends with one line on the logger
``dplb.router.access``, which logs at INFO whatever the router's ``log_level`` (like nginx's
``access_log``, it is switched by its own setting, ``router.access_log``):

    text: ``rid=7f3a... POST /v1/chat/completions model=llama worker=2 status=200 ttft_ms=41.2
          duration_ms=812.0 prompt_tokens=118 output_tokens=64 attempts=1 queue_ms=0.0``
    json: the same fields as one JSON object per line, nothing else on it (``router.access_log:
          json``), for log shippers and ``jq``.

``ttft_ms`` is the time from the request's arrival to its first content (streams; ``-`` when none
was seen), ``duration_ms`` from its arrival to the end of its answer; tokens are the engine's
``usage`` where it sent one, else the router's estimate of the prompt and its count of streamed
events (a stream its client cut, logged 499, counts the events the client was written);
``queue_ms`` the time it waited in the router's admission queue (docs/admission.md; 0.0 when it
went at once); ``worker`` is ``-`` when no worker was chosen; ``model`` is the model the request named (also on a
404 for an unknown one), ``-`` when it named none or its body did not parse. A refusal before any
worker (400, 401, 404, 405, 413, 415) has its line too, under the same minted ``rid`` it was
answered with. Every 5xx also gets a WARNING line with its
cause, on ``dplb.router`` (:func:`AccessLog.emit`'s ``cause``), rate-limited per status and cause
(:data:`REPEATS`: one line, then a count every 10 s while they repeat, e.g. the 503s of a drain).

What the client sent (``rid`` from its ``X-Request-Id``, ``method``, ``route``, ``model``, and the
error message quoting them) is escaped and cut to 256 characters (:mod:`router.logtext`): in text
lines a value holding a space, ``=`` or ``"`` is double-quoted, so that no client can end the line
or add a field (``X-Request-Id: x worker=9 status=500`` logs ``rid="x worker=9 status=500"``); JSON
lines are valid JSON whatever the bytes (orjson escapes them), their values cut the same way.

The lines are written in batches: where the logger writes through the router's own handler
(:func:`router.app.configure_logging`'s stream handler and format on the root logger, or the JSON
mode's handler) and nothing else listens, a line is formatted here exactly as that handler would
format it and appended to a buffer (:class:`_Batch`), written in one ``write`` every
:data:`FLUSH_S` seconds or :data:`FLUSH_LINES` lines, before any other record the handler writes (a
filter of its own keeps the file in order), and at exit. Anything else (other handlers, a
formatter of one's own, pytest's ``caplog``) gets the records through :mod:`logging` as before.
A line costs about a third of what a record did (``bench/results/long-prompts.md``); a router
killed with SIGKILL loses at most the last :data:`FLUSH_S` seconds of lines.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import time

import orjson

from router.logtext import LOG_FORMAT, MAX_LINE, OneLineFilter, field, one_line, text
from router.repeats import RepeatLimiter

log = logging.getLogger("dplb.router.access")
errors = logging.getLogger("dplb.router")
#: the 5xx WARNING lines, one per (status, cause) every 10 s with a count of the rest
REPEATS = RepeatLimiter(errors)


class AccessLog:
    """Writes the access lines (``mode``: ``text``, ``json`` or ``off``)."""

    __slots__ = ("json", "on")

    def __init__(self, mode: str = "text") -> None:
        self.on = mode != "off"
        self.json = mode == "json"
        if self.on and log.level == logging.NOTSET:
            log.setLevel(logging.INFO)   # independent of the router's log_level
        if self.json and not any(getattr(h, "dplb_json", False) for h in log.handlers):
            # one JSON object per line, nothing before it (log shippers, jq): a handler of its own
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(message)s"))
            h.dplb_json = True  # type: ignore[attr-defined]
            h.addFilter(OneLineFilter())
            log.addHandler(h)
            log.propagate = False

    def emit(self, rid: bytes, method: str, route: str, model: str | None, worker: str, status: int,
             duration_s: float, ttft_s: float | None = None, prompt_tokens: int | None = None,
             output_tokens: int | None = None, attempts: int = 1, cause: str | None = None,
             queue_s: float = 0.0) -> None:
        """Log one request (times in s; ``worker`` the worker's label or ``none``; ``queue_s``: its
        wait in the admission queue); a 5xx also logs ``cause`` (the error message the client got)
        at WARNING."""
        r = rid.decode("latin-1")
        w = "-" if worker in ("", "none") else worker
        if status >= 500:   # one line per kind (status, cause) every 10 s, then a count (router.repeats)
            why = text(cause or "no cause recorded", 1024)
            REPEATS.warning(f'{status} "{why[:160]}"', "request %s (%s %s, model %s) answered %d by worker %s: %s",
                            text(r), text(method), text(route), text(model or "-"), status, w, why)
        if not self.on or not log.isEnabledFor(logging.INFO):
            return
        batch = _batch()
        if self.json:
            line = orjson.dumps({"rid": _cut(r), "method": _cut(method), "route": _cut(route),
                                 "model": None if model is None else _cut(model), "worker": w,
                                 "status": status, "ttft_ms": None if ttft_s is None else round(ttft_s * 1e3, 1),
                                 "duration_ms": round(duration_s * 1e3, 1), "prompt_tokens": prompt_tokens,
                                 "output_tokens": output_tokens, "attempts": attempts,
                                 "queue_ms": round(queue_s * 1e3, 1)}).decode()
        else:
            # the line made here, once: a record then carries no arguments to merge (its message
            # is read by the one-line filter and by the formatter)
            line = (f"rid={field(r)} {_field(method)} {_field(route)} model={_field(model or '-')} worker={w} "
                    f"status={status} ttft_ms={'-' if ttft_s is None else f'{ttft_s * 1e3:.1f}'} "
                    f"duration_ms={duration_s * 1e3:.1f} "
                    f"prompt_tokens={'-' if prompt_tokens is None else prompt_tokens} "
                    f"output_tokens={'-' if output_tokens is None else output_tokens} attempts={attempts} "
                    f"queue_ms={'0.0' if queue_s == 0.0 else f'{queue_s * 1e3:.1f}'}")   # most went at once: no float format
        if batch is None:
            log.info(line)
        else:
            batch.put(line)


#: seconds a batch of access lines waits at most before its write
FLUSH_S = 0.05
#: lines a batch holds at most (then written at once)
FLUSH_LINES = 128
#: the record prefix of the router's format (LOG_FORMAT) after its time stamp, for this logger
_TEXT_PREFIX = f" INFO {log.name}: "


class _Batch:
    """The access lines waiting for one write to ``handler``'s stream, each formatted as the
    handler's formatter would (``text``: LOG_FORMAT's ``asctime`` in local time with
    milliseconds, then level and logger; ``json``: the message alone) and kept on one line
    (:func:`router.logtext.one_line`, the handler's own filter). Used from the event loop's thread;
    :meth:`flush` may run from any (under the handler's lock)."""

    __slots__ = ("handler", "lines", "second", "stamp", "text", "timer")

    def __init__(self, handler: logging.StreamHandler, text: bool) -> None:
        self.handler = handler
        self.text = text
        self.lines: list[str] = []
        self.second = -1
        self.stamp = ""
        self.timer: asyncio.TimerHandle | None = None

    def put(self, msg: str) -> None:
        """Queue the line of message ``msg``; schedules its write (:data:`FLUSH_S`), or writes now
        when no event loop runs here or the batch is full."""
        if len(msg) > MAX_LINE or not msg.isprintable():
            msg = one_line(msg)
        if self.text:
            # logging.LogRecord's created/msecs and logging.Formatter.formatTime's default format
            ct = time.time()
            sec = int(ct)
            if sec != self.second:
                self.second = sec
                self.stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ct))
            msg = f"{self.stamp},{int((ct - sec) * 1000):03d}{_TEXT_PREFIX}{msg}"
        lines = self.lines
        lines.append(msg)
        if len(lines) >= FLUSH_LINES:
            self.flush()
        elif self.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self.timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Write the waiting lines in one ``write`` (then the stream's flush), as the handler's
        ``emit`` would; a stream that fails is reported by the handler (``handleError``)."""
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        h = self.handler
        with h.lock:   # type: ignore[union-attr]
            lines, self.lines = self.lines, []
            if not lines:
                return
            lines.append("")
            try:
                h.stream.write(h.terminator.join(lines))
                h.flush()
            except (OSError, ValueError):   # a closed or failing stream: the handler reports it, as in its emit
                h.handleError(logging.makeLogRecord({"name": log.name, "msg": lines[0]}))


class _FlushFirst(logging.Filter):
    """On a handler that :class:`_Batch` writes to: the waiting access lines are written before any
    other record the handler writes, so the file stays in time order."""

    def __init__(self, batch: _Batch) -> None:
        super().__init__()
        self.batch = batch

    def filter(self, record: logging.LogRecord) -> bool:
        """Flush the batch; always keeps the record."""
        if self.batch.lines:
            self.batch.flush()
        return True


#: the batch of each handler written to this way (at most the router's two)
_BATCHES: dict[int, _Batch] = {}


def _plain(h: logging.Handler, fmt: str) -> bool:
    """Whether ``h`` writes exactly what :class:`_Batch` writes with format ``fmt``: a plain
    stream handler, the standard formatter with that format (``%`` style, the default date format
    in local time), only the one-line and flush filters, and INFO records."""
    f = h.formatter
    return (type(h) is logging.StreamHandler and type(f) is logging.Formatter and h.level <= logging.INFO
            and f._fmt == fmt and f.datefmt is None and isinstance(f._style, logging.PercentStyle)
            and f.converter is time.localtime and f.default_msec_format == "%s,%03d"
            and all(isinstance(x, (OneLineFilter, _FlushFirst)) for x in h.filters))


def _batch() -> _Batch | None:
    """The batch the access lines go to, or None: the logging configuration is not the router's
    own (they go through :mod:`logging`). Checked at each line (a handler may come or go)."""
    if log.filters:
        return None
    if log.propagate:
        hs = logging.root.handlers
        if log.handlers or len(hs) != 1 or logging.root.filters:
            return None
        text_ = True
    else:
        hs = log.handlers
        if len(hs) != 1:
            return None
        text_ = False
    h = hs[0]
    b = _BATCHES.get(id(h))
    if b is not None and b.handler is h:
        return b
    if not _plain(h, LOG_FORMAT if text_ else "%(message)s"):
        return None
    b = _BATCHES[id(h)] = _Batch(h, text_)   # type: ignore[arg-type]
    h.addFilter(_FlushFirst(b))
    return b


def flush() -> None:
    """Write every waiting access line now (at the router's stop and at exit)."""
    for b in list(_BATCHES.values()):
        b.flush()


atexit.register(flush)


#: field() of the values that repeat from line to line (methods, routes, model names), bounded: the
#: values come from clients, so the cache is emptied when it holds _FIELDS_MAX of them
_FIELDS: dict[str, str] = {}
_FIELDS_MAX = 1024


def _field(value: str) -> str:
    """:func:`router.logtext.field` of ``value``, remembered."""
    f = _FIELDS.get(value)
    if f is None:
        if len(_FIELDS) >= _FIELDS_MAX:
            _FIELDS.clear()
        f = _FIELDS[value] = field(value)
    return f


def _cut(s: str, limit: int = 256) -> str:
    """A JSON access-log value: at most ``limit`` characters plus ``...(+N chars)`` (orjson escapes
    the rest)."""
    return s if len(s) <= limit else f"{s[:limit]}...(+{len(s) - limit} chars)"


__all__ = ["FLUSH_LINES", "FLUSH_S", "AccessLog", "flush", "text"]
