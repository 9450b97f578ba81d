"""Client data in log lines: escaped, quoted where it could pose as a field, cut to a bounded length.

A log line is data that operators and log shippers parse: one record per line, ``key=value``
fields. Anything a client controls (the model it names, its ``X-Request-Id``, the path, a header,
an error message that quotes them) must not be able to end the line and forge another one, add a
field that looks like the router's own (``rid=x worker=9 status=500``), or fill the disk with a
4 MiB model name. Three helpers, used wherever a log call takes request data:

- :func:`text`: the value escaped and cut, for prose lines (``request %s answered 502: %s``);
- :func:`field`: the same, double-quoted (logfmt) when it holds a space, ``=`` or ``"`` or is
  empty, for ``key=value`` lines such as the access line;
- :class:`OneLineFilter`: the safety net on the router's and picker's log handlers, which escapes
  any line break or control character left in a whole message and cuts it at :data:`MAX_LINE`.

Escapes follow Python's string literals: ``\\\\`` for a backslash, ``\\"`` for a quote inside a
quoted value, ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN`` for every character that is not printable
(``str.isprintable``: C0/C1 controls, DEL, U+2028/U+2029 line and paragraph separators, other
format characters). A cut value ends with ``...(+N chars)``.
"""
from __future__ import annotations

import logging
import re

#: characters of one client-supplied value kept in a log line (a model name, a request id, a path)
MAX_FIELD = 256
#: characters of one whole log message kept by :class:`OneLineFilter` (its traceback aside)
MAX_LINE = 16384
#: the router's log format (:func:`router.app.configure_logging`)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"



def _escape(s: str, quote: bool) -> str:
    out = []
    for c in s:
        if c == "\\":
            out.append("\\\\")
        elif c == '"' and quote:
            out.append('\\"')
        elif c.isprintable():
            out.append(c)
        else:
            o = ord(c)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def _str(value: object) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return value if isinstance(value, str) else str(value)


def text(value: object, limit: int = MAX_FIELD) -> str:
    """``value`` (str, bytes decoded as UTF-8 with ``\\xNN`` for bad bytes, or anything ``str``
    takes) with its backslashes and unprintable characters escaped, cut to its first ``limit``
    characters (escaping can lengthen those to at most 10 ``limit`` characters) plus
    ``...(+N chars)``. Never raises."""
    s = _str(value)
    extra = len(s) - limit
    if extra > 0:
        s = s[:limit]
    if not s.isprintable() or "\\" in s:
        s = _escape(s, False)
    return f"{s}...(+{extra} chars)" if extra > 0 else s


#: a value :func:`field` leaves as it is: nothing to escape, cut or quote
_plain = re.compile(r"[\w.:/+-]+", re.ASCII).fullmatch


def field(value: object, limit: int = MAX_FIELD) -> str:
    """``value`` as the value of a ``key=value`` log field: :func:`text`'s escaping and cut, and
    double quotes around it (with ``\\"`` inside) when it is empty or holds a space, ``=`` or
    ``"``, so that it can never read as a field of its own (logfmt's quoting). A string of at
    most ``limit`` ASCII letters, digits and ``_.:/+-`` (a request id, minted or a client's UUID;
    a method, a route) is returned as it is, without the checks: none of them would change it."""
    if type(value) is str and len(value) <= limit and _plain(value):
        return value
    return _checked(_str(value), limit)


def _checked(s: str, limit: int) -> str:
    # field() of ``s`` through every check (the reference its shortcut is tested against)
    extra = len(s) - limit
    if extra > 0:
        s = s[:limit]
    needs_quote = not s or extra > 0 or " " in s or "=" in s or '"' in s
    if not s.isprintable() or "\\" in s or needs_quote:
        s = _escape(s, needs_quote)
    if extra > 0:
        s = f"{s}...(+{extra} chars)"
    return f'"{s}"' if needs_quote else s


def _json_escape(c: str) -> str:
    """``\\uNNNN`` (a surrogate pair beyond the BMP): valid inside a JSON string as in text."""
    o = ord(c)
    if o < 0x10000:
        return f"\\u{o:04x}"
    o -= 0x10000
    return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"


class OneLineFilter(logging.Filter):
    """A handler filter: a record's message (its arguments merged in) becomes one line with every
    unprintable character escaped as ``\\uNNNN`` (JSON's escape, so a JSON access line stays
    valid JSON with the same value; backslashes are left as they are, so values already escaped
    by :func:`text` or :func:`field` stay readable) and at most
    :data:`MAX_LINE` characters. A traceback (``exc_info``) is the router's own and keeps its
    lines. Installed by :func:`install` on the root logger's handlers."""

    dplb_one_line = True

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record.msg`` when needed; always keeps the record."""
        try:
            msg = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: logging reports it itself
            return True
        if len(msg) <= MAX_LINE and msg.isprintable():
            return True
        record.msg = one_line(msg)
        record.args = None
        return True


def one_line(msg: str) -> str:
    """``msg`` as :class:`OneLineFilter` leaves a record's message: every unprintable character
    escaped as ``\\uNNNN``, cut to :data:`MAX_LINE` characters plus ``...(+N chars)``."""
    extra = len(msg) - MAX_LINE
    if extra > 0:
        msg = msg[:MAX_LINE]
    if not msg.isprintable():
        msg = "".join(c if c.isprintable() else _json_escape(c) for c in msg)
    return f"{msg}...(+{extra} chars)" if extra > 0 else msg


def uvicorn_log_config() -> dict[str, object]:
    """uvicorn's default logging configuration (``uvicorn.config.LOGGING_CONFIG``, a copy) with a
    :class:`OneLineFilter` on each of its handlers: uvicorn's own loggers do not propagate to the
    root logger, so :func:`install` does not reach them. Pass as ``uvicorn.run(log_config=...)``."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg.setdefault("filters", {})["dplb_one_line"] = {"()": "router.logtext.OneLineFilter"}
    for h in cfg.get("handlers", {}).values():
        h.setdefault("filters", []).append("dplb_one_line")
    return cfg


def install(logger: logging.Logger | None = None) -> None:
    """Add one :class:`OneLineFilter` to every handler of ``logger`` (the root logger when None)
    that has none yet; idempotent."""
    for h in (logger or logging.getLogger()).handlers:
        if not any(getattr(f, "dplb_one_line", False) for f in h.filters):
            h.addFilter(OneLineFilter())


__all__ = ["LOG_FORMAT", "MAX_FIELD", "MAX_LINE", "OneLineFilter", "field", "install", "one_line", "text", "uvicorn_log_config"]
