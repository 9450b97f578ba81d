"""The access lines written in batches (router/access_log.py's ``_Batch``): the same bytes as a
record through :mod:`logging` would give, in time order with the router's other lines, written
at the batch's deadline and at the router's stop, and :mod:`logging`'s path kept for any other
configuration (another handler, pytest's caplog)."""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Iterator

import pytest

import router.access_log as al
from router.logtext import LOG_FORMAT, OneLineFilter

LINES = [  # (rid, model, status, ttft_s, prompt, out): a plain one, client bytes to escape, a long model
    (b"rid-1", "llama", 200, 0.0412, 118, 64),
    (b"x worker=9 status=500", "m\nforged=1", 404, None, None, None),
    (b"rid-3", "q" * 20000, 200, None, 3, 1),
    (b"rid-4", "caf\u00e9\u2028", 429, None, None, None),
]


@contextlib.contextmanager
def _own_logging(buf: io.StringIO) -> Iterator[logging.Handler]:
    """The router's own logging (configure_logging's shape) writing to ``buf``, alone on the root
    logger (pytest's capture handlers taken off for the block); restored after."""
    h = logging.StreamHandler(buf)
    h.setFormatter(logging.Formatter(LOG_FORMAT))
    h.addFilter(OneLineFilter())
    root = logging.root
    saved = root.handlers[:], root.level, al.log.level, al.log.handlers[:], al.log.propagate
    root.handlers[:] = [h]
    root.setLevel(logging.WARNING)
    al.log.handlers[:] = []
    al.log.propagate = True
    al.log.setLevel(logging.NOTSET)
    try:
        yield h
    finally:
        al.flush()
        root.handlers[:], lvl, alvl, al.log.handlers[:], al.log.propagate = saved
        root.setLevel(lvl)
        al.log.setLevel(alvl)


@pytest.fixture
def buf(monkeypatch) -> Iterator[io.StringIO]:
    """A log stream; the clock pinned (a record's time and a batch's both come from time.time,
    CPython 3.11's LogRecord), the 5xx warnings on a logger of their own."""
    monkeypatch.setattr(time, "time", lambda: 1_765_000_000.123456)
    yield io.StringIO()


def _emit_all(a: al.AccessLog) -> None:
    for rid, model, status, ttft, prompt, out in LINES:
        a.emit(rid, "POST", "/v1/chat/completions", model, "2", status, 0.8123, ttft, prompt, out, 1)


@pytest.mark.parametrize("mode", ["text", "json"])
def test_a_batched_line_is_the_line_logging_writes(buf, mode):
    with _own_logging(buf):
        a = al.AccessLog(mode)
        if mode == "json":   # the JSON mode's own handler (on stderr) writes to buf
            al.log.handlers[0].setStream(buf)   # type: ignore[attr-defined]
        assert al._batch() is not None, "the router's own configuration must take the batched path"
        _emit_all(a)
        al.flush()
        batched = buf.getvalue()
        # the same lines through logging: a second handler on the root (or the JSON logger) is
        # not the router's configuration, so each line is a record again
        buf.seek(0)
        buf.truncate()
        other = logging.NullHandler()
        on = al.log if mode == "json" else logging.root
        on.addHandler(other)
        try:
            assert al._batch() is None
            _emit_all(a)
        finally:
            on.removeHandler(other)
            if mode == "json":   # the JSON mode's own handler, added by AccessLog
                al.log.handlers[:] = []
    assert batched == buf.getvalue()
    assert batched.count("\n") == len(LINES)
    assert "...(+" in batched and "\\u2028" in batched and "\n" not in batched.split("m", 1)[0]


def test_lines_wait_for_their_deadline_and_keep_time_order_with_other_records(buf):
    async def run() -> tuple[str, str, str]:
        a = al.AccessLog("text")
        a.emit(b"rid-a", "POST", "/v1/chat/completions", "m", "0", 200, 0.001)
        waiting = buf.getvalue()
        logging.getLogger("dplb.router").warning("a warning after the first line")
        a.emit(b"rid-b", "POST", "/v1/chat/completions", "m", "0", 200, 0.001)
        before = buf.getvalue()
        deadline = time.monotonic() + 30
        while "rid=rid-b " not in buf.getvalue() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return waiting, before, buf.getvalue()

    with _own_logging(buf):
        waiting, before, after = asyncio.run(run())
    assert waiting == ""                                   # batched, not written at once
    assert "rid=rid-a " in before and "rid=rid-b " not in before
    assert before.index("rid=rid-a ") < before.index("a warning after")   # written before the warning
    assert "rid=rid-b " in after                          # then at the batch's deadline


def test_a_full_batch_is_written_at_once(buf):
    async def run() -> int:
        a = al.AccessLog("text")
        for i in range(al.FLUSH_LINES):
            a.emit(b"rid-%d" % i, "POST", "/v1/chat/completions", "m", "0", 200, 0.001)
        return buf.getvalue().count("\n")

    with _own_logging(buf):
        assert asyncio.run(run()) == al.FLUSH_LINES


def test_caplog_sees_every_access_line(caplog):
    caplog.set_level(logging.INFO, logger=al.log.name)
    al.AccessLog("text").emit(b"rid-cap", "POST", "/v1/chat/completions", "m", "0", 200, 0.001)
    assert any("rid=rid-cap " in r.getMessage() for r in caplog.records)
