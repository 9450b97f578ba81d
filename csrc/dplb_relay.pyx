# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""router._relay: the native half of the router's stream relay (issue 14).

:class:`ChunkRelay` takes the engine's chunked body bytes exactly as one socket read brought them,
decodes the HTTP/1.1 chunked framing (RFC 9112 §7.1: hex size line with optional extensions, data,
CRLF; a zero-size chunk, optional trailer lines, CRLF), and writes everything the read carried to
the client as one chunk, framed as uvicorn frames a body message (``<hex size>\\r\\n<data>\\r\\n``).
On the way it counts SSE event separators (``\\n\\n``) and keeps the last 4 KiB of the payload, so
that the router's stream meter (router/stream_meter.py) can count tokens and read the usage at the
end without seeing each chunk. No Python frame runs per chunk except the protocol's
``data_received`` that calls :meth:`ChunkRelay.feed`.

The router hands a stream to the relay only at a chunk boundary and only after the stream's first
content (router/transport.py ``Upstream.pipe``); everything before goes through httptools and the
meter in Python.

With ``end=True`` the relay also ends the client's body: the read that completes the engine's body
goes to the client in the same write as the terminating chunk (``0\\r\\n\\r\\n``), one write where
there were two; ``ended`` then tells the router's writer that the terminator is out
(router/server.py ``ChunkedWriter.finish``). Unless the body's last 4 KiB hold ``"abort"`` (an
engine-side ``finish_reason: "abort"``, or a false alarm the router's Python side tells apart; also
when a read split that word): then
the terminator is left to ``ChunkedWriter.finish``, which writes the SSE error event of a truncated
answer before it (router/relay.py); a ``data: [DONE]`` event that ends such a read is not written
either (``held_done``): the writer puts it after the error event, which never follows a ``[DONE]``.
A read of such a stream that ends inside a ``data: [DONE]`` event (a network read cuts anywhere) keeps
that event's start back until the next read tells: the whole ``[DONE]`` is held as above, anything
else is written after those bytes, unchanged.
"""
from libc.string cimport memcmp, memcpy, memmove


cdef extern from "<string.h>" nogil:
    void *memmem(const void *haystack, size_t haystacklen, const void *needle, size_t needlelen)
from libc.stdlib cimport malloc, realloc, free


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE

cdef enum:
    TAIL = 4096         # payload bytes kept for the meter's last events
    HEAD_ROOM = 24      # room before the payload for the re-framed size line
    FOOT_ROOM = 7       # after the payload: its CRLF and the terminating chunk ``0\r\n\r\n``

cdef const char *HEXD = b"0123456789abcdef"

cdef enum:
    S_SIZE = 0          # hex digits of a chunk size
    S_EXT = 1           # chunk extension, up to CR
    S_SIZE_LF = 2
    S_DATA = 3
    S_DATA_CR = 4
    S_DATA_LF = 5
    S_TRAILER = 6       # start of a trailer line (or of the final CRLF)
    S_TRAILER_LINE = 7
    S_END_LF = 8
    S_DONE = 9

#: :meth:`ChunkRelay.feed` results
OK = 0
CLIENT_FULL = 1         # the client's transport is above its high-water mark: pause reading
CLIENT_GONE = 2         # the client left: nothing was written


cdef inline int _hex(unsigned char c) noexcept:
    if c >= 48 and c <= 57:
        return c - 48
    if c >= 97 and c <= 102:
        return c - 87
    if c >= 65 and c <= 70:
        return c - 55
    return -1


cdef Py_ssize_t _done_suffix(const unsigned char *p, Py_ssize_t n):
    """The length of a ``data: [DONE]`` event (with its blank line; also without the space) that
    ends the ``n`` bytes at ``p``, at their start or after a line break; 0 when there is none."""
    cdef Py_ssize_t k = 0
    if n >= 14 and memcmp(p + n - 14, b"data: [DONE]\n\n", 14) == 0:
        k = 14
    elif n >= 13 and memcmp(p + n - 13, b"data:[DONE]\n\n", 13) == 0:
        k = 13
    if k and (n == k or p[n - k - 1] == 10):
        return k
    return 0


cdef Py_ssize_t _done_start(const unsigned char *p, Py_ssize_t n):
    """The length of the start of a ``data: [DONE]`` event (not the whole event; also without the
    space) that ends the ``n`` bytes at ``p``, at their start or after a line break; 0 when there
    is none."""
    cdef Py_ssize_t i = n - 1
    if n == 0:
        return 0
    while i > 0 and n - i < 14 and p[i - 1] != 10:
        i -= 1
    if n - i >= 14 or (i > 0 and p[i - 1] != 10):
        return 0
    if memcmp(p + i, b"data: [DONE]\n\n", n - i) == 0 or (n - i < 13 and memcmp(p + i, b"data:[DONE]\n\n", n - i) == 0):
        return n - i
    return 0


cdef class ChunkRelay:
    """Relay of one chunked response body from an engine's connection to a client's transport.

    ``write``: the client transport's ``write`` (bytes → None); ``client``: an object whose
    ``disconnected`` attribute is true once the client left (uvicorn's request cycle); ``flow``: an
    object whose ``write_paused`` attribute is true while the client's transport is above its
    high-water mark (uvicorn's flow control). ``carry``: the last payload byte the meter saw before
    the relay took over (b"" for none), for a separator that straddles the hand-over. ``end``: write
    the terminating chunk after the body's last payload (module docstring). ``before``: the payload's
    last bytes before the hand-over (the stream meter's tail), for an ``"abort"`` in them or split
    across the hand-over by a chunk boundary (an abort event not yet whole there).

    After :meth:`feed`: ``done`` (the terminating chunk and trailers were read), ``failed`` (the
    framing was not valid chunked encoding: the connection must be dropped), ``extra`` (bytes
    followed the end of the body: do not reuse the connection), ``events`` (``\\n\\n`` separators in
    the relayed payload, counted as ``bytes.count`` counts them per read plus one straddling two
    reads, the rule of ``StreamMeter.feed``), ``relayed`` (payload bytes written; ``base``: see :meth:`progress`), ``ended`` (the
    terminating chunk was written to the client: ``end`` and ``done``), ``held_done`` (a read ended
    with ``data: [DONE]`` while ``"abort"`` was in the relayed tail or the read: that event was not
    written nor metered; the router's writer writes it after the abort's error event). A read
    that ends with the start of such a ``[DONE]`` event keeps those bytes (``pend``) for the next
    read, which decides (module docstring).
    """

    cdef int state
    cdef unsigned long long size
    cdef int digits         # significant hex digits of the size so far (at most 15)
    cdef bint saw           # any hex digit in this size line
    cdef object _write
    cdef object _client
    cdef object _flow
    cdef unsigned char *buf
    cdef Py_ssize_t cap
    cdef unsigned char tailbuf[TAIL]
    cdef Py_ssize_t tail_len
    cdef unsigned char last
    cdef unsigned char pre[6]   # the payload's last bytes before the hand-over (see ``before``)
    cdef Py_ssize_t pre_len
    cdef bint pre_abort         # ``"abort"`` in ``before``
    cdef unsigned char pend[14] # the start of a [DONE] event held back from the last read
    cdef Py_ssize_t pend_len
    cdef public bint done
    cdef public bint failed
    cdef public bint extra
    cdef public bint ended
    cdef public bint held_done
    cdef bint _end
    cdef public long long events
    cdef public long long relayed
    cdef public long long base

    def __cinit__(self):
        self.buf = NULL
        self.cap = 0

    def __init__(self, write, client, flow, bytes carry=b"", bint end=False, bytes before=b""):
        self._write = write
        self._client = client
        self._flow = flow
        self.state = S_SIZE
        self.size = 0
        self.digits = 0
        self.saw = False
        self.tail_len = 0
        self.last = <unsigned char>(carry[len(carry) - 1]) if carry else 0
        self.pre_len = len(before) if len(before) < 6 else 6
        if self.pre_len:
            memcpy(self.pre, PyBytes_AS_STRING(before) + len(before) - self.pre_len, self.pre_len)
        self.pre_abort = b'"abort"' in before
        self.done = False
        self.failed = False
        self.extra = False
        self.ended = False
        self.held_done = False
        self.pend_len = 0
        self._end = end
        self.events = 0
        self.relayed = 0
        self.base = 0

    def __dealloc__(self):
        if self.buf != NULL:
            free(self.buf)

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef unsigned char *p
        if n <= self.cap:
            return 0
        if n < 4096:
            n = 4096
        p = <unsigned char *>realloc(self.buf, n)
        if p == NULL:
            raise MemoryError()
        self.buf = p
        self.cap = n
        return 0

    cdef Py_ssize_t _decode(self, const unsigned char *src, Py_ssize_t n, unsigned char *dst) noexcept:
        """Decode ``n`` framed bytes into ``dst`` (payload only); returns the payload length. Sets
        ``failed``/``done``/``extra``."""
        cdef Py_ssize_t i = 0, out = 0, take
        cdef unsigned char c
        cdef int h, st
        while i < n:
            st = self.state
            if st == S_DATA:
                take = n - i
                if <unsigned long long>take > self.size:
                    take = <Py_ssize_t>self.size
                memcpy(dst + out, src + i, take)
                out += take
                i += take
                self.size -= take
                if self.size == 0:
                    self.state = S_DATA_CR
                continue
            c = src[i]
            i += 1
            if st == S_SIZE:
                h = _hex(c)
                if h >= 0:
                    self.saw = True
                    if self.size != 0 or h != 0:   # leading zeros are valid and do not count
                        if self.digits >= 15:
                            self.failed = True
                            return out
                        self.digits += 1
                    self.size = (self.size << 4) | <unsigned long long>h
                elif not self.saw:
                    self.failed = True
                    return out
                elif c == 13:       # CR
                    self.state = S_SIZE_LF
                elif c == 59 or c == 32 or c == 9:   # ';' extension (or whitespace before it)
                    self.state = S_EXT
                else:
                    self.failed = True
                    return out
            elif st == S_EXT:
                if c == 13:
                    self.state = S_SIZE_LF
                elif c == 10:
                    self.failed = True
                    return out
            elif st == S_SIZE_LF:
                if c != 10:
                    self.failed = True
                    return out
                self.digits = 0
                self.saw = False
                self.state = S_DATA if self.size > 0 else S_TRAILER
            elif st == S_DATA_CR:
                if c != 13:
                    self.failed = True
                    return out
                self.state = S_DATA_LF
            elif st == S_DATA_LF:
                if c != 10:
                    self.failed = True
                    return out
                self.state = S_SIZE
                self.size = 0
            elif st == S_TRAILER:
                if c == 13:
                    self.state = S_END_LF
                else:
                    self.state = S_TRAILER_LINE
            elif st == S_TRAILER_LINE:
                if c == 10:
                    self.state = S_TRAILER
            elif st == S_END_LF:
                if c != 10:
                    self.failed = True
                    return out
                self.state = S_DONE
                self.done = True
            else:   # S_DONE: bytes after the body
                self.extra = True
                return out
        return out

    cdef bint _abort_across(self, const unsigned char *p, Py_ssize_t n) noexcept:
        """Whether ``"abort"`` straddles the relayed tail's end and the ``n`` bytes at ``p`` (a
        read that split the abort event inside that word)."""
        cdef unsigned char j[12]
        cdef Py_ssize_t a = self.tail_len if self.tail_len < 6 else 6
        cdef Py_ssize_t b = n if n < 6 else 6
        memcpy(j, self.tailbuf + self.tail_len - a, a)
        memcpy(j + a, p, b)
        return memmem(j, a + b, b'"abort"', 7) != NULL

    cdef bint _abort_before(self, const unsigned char *p, Py_ssize_t n) noexcept:
        """Whether ``"abort"`` is in the payload before the hand-over (``before``) or straddles it
        and the relayed payload followed by the ``n`` bytes at ``p`` (only while the relayed tail
        still starts at the hand-over: at most 4 KiB relayed, the reach of the tail's own check)."""
        cdef unsigned char j[12]
        cdef Py_ssize_t a = self.pre_len, b, c
        if a == 0 or self.relayed != self.tail_len:
            return False
        if self.pre_abort:
            return True
        memcpy(j, self.pre, a)
        b = self.tail_len if self.tail_len < 6 else 6
        memcpy(j + a, self.tailbuf, b)
        c = 6 - b
        if c > n:
            c = n
        if c > 0:
            memcpy(j + a + b, p, c)
        else:
            c = 0
        return memmem(j, a + b + c, b'"abort"', 7) != NULL

    cdef bint _abort_seen(self, const unsigned char *p, Py_ssize_t n) noexcept:
        """Whether ``"abort"`` is in the relayed tail, in the ``n`` bytes at ``p`` (this read's
        payload), across the two, or before the hand-over (:meth:`_abort_before`)."""
        return (memmem(self.tailbuf, self.tail_len, b'"abort"', 7) != NULL
                or (n > 0 and (memmem(p, n, b'"abort"', 7) != NULL or self._abort_across(p, n)))
                or self._abort_before(p, n))

    cdef void _account(self, const unsigned char *p, Py_ssize_t n) noexcept:
        cdef Py_ssize_t i = 0, keep
        cdef long long k = 0
        if self.last == 10 and p[0] == 10 and not (n >= 2 and p[1] == 10):
            k += 1          # a separator straddling the previous read and this one
        while i + 1 < n:
            if p[i] == 10 and p[i + 1] == 10:
                k += 1
                i += 2
            else:
                i += 1
        self.events += k
        self.last = p[n - 1]
        if n >= TAIL:
            memcpy(self.tailbuf, p + n - TAIL, TAIL)
            self.tail_len = TAIL
        else:
            keep = TAIL - n
            if keep > self.tail_len:
                keep = self.tail_len
            memmove(self.tailbuf, self.tailbuf + self.tail_len - keep, keep)
            memcpy(self.tailbuf + keep, p, n)
            self.tail_len = keep + n

    def feed(self, bytes data):
        """Decode one read's bytes and write their payload to the client as one chunk. Returns
        :data:`OK`, :data:`CLIENT_FULL` (written; pause reading until the client drains) or
        :data:`CLIENT_GONE` (the client left; nothing written). Check ``done``/``failed`` after."""
        return self._feed(data)

    cdef int _feed(self, bytes data) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t pay, start, stop, k
        cdef unsigned char *p
        cdef unsigned long long v
        cdef bint end
        if self.failed or n == 0:
            return OK
        self._reserve(n + HEAD_ROOM + FOOT_ROOM + 14)
        p = self.buf + HEAD_ROOM
        memcpy(p, self.pend, self.pend_len)   # the start of a [DONE] held back from the last read
        pay = self.pend_len + self._decode(<const unsigned char *>PyBytes_AS_STRING(data), n, p + self.pend_len)
        self.pend_len = 0
        end = self._end and self.done and not self.ended
        k = _done_suffix(p, pay)
        if (end or k) and self._abort_seen(p, pay):
            end = False   # an engine's abort, maybe: the writer ends the body, after its error event
            if k and not self.held_done:
                pay -= k  # and its [DONE] after that event, never before it
                self.held_done = True
        elif not self.done and not self.held_done:
            k = _done_start(p, pay)
            if k and self._abort_seen(p, pay):
                pay -= k  # a read cut inside that [DONE]: its start waits for the next read
                memcpy(self.pend, p + pay, k)
                self.pend_len = k
        if pay == 0 and not end:
            return OK
        if self._client.disconnected:
            return CLIENT_GONE
        if pay == 0:
            # a read that held only the engine's terminating chunk (and trailers)
            self.ended = True
            self._write(b"0\r\n\r\n")
            return CLIENT_FULL if self._flow.write_paused else OK
        self._account(self.buf + HEAD_ROOM, pay)
        # the size line, right-aligned before the payload
        start = HEAD_ROOM - 2
        self.buf[start] = 13
        self.buf[start + 1] = 10
        v = <unsigned long long>pay
        while True:
            start -= 1
            self.buf[start] = <unsigned char>HEXD[v & 15]
            v >>= 4
            if v == 0:
                break
        stop = HEAD_ROOM + pay
        self.buf[stop] = 13
        self.buf[stop + 1] = 10
        stop += 2
        if end:
            memcpy(self.buf + stop, b"0\r\n\r\n", 5)
            stop += 5
            self.ended = True
        self._write(PyBytes_FromStringAndSize(<char *>self.buf + start, stop - start))
        self.relayed += pay
        return CLIENT_FULL if self._flow.write_paused else OK

    def progress(self):
        """``base + events``: the stream's output tokens so far when ``base`` holds the events the
        router's stream meter counted before the hand-over (router/relay.py sets it). Read for
        every stream in flight on a worker at each routing decision there (the TPOT-SLO term,
        router/policies/tpot_slo.py): one C call, where a Python closure cost about 1 µs."""
        return self.base + self.events

    def tail(self):
        """The last payload bytes relayed (up to 4 KiB)."""
        return PyBytes_FromStringAndSize(<char *>self.tailbuf, self.tail_len)

    def last_byte(self):
        """The last payload byte relayed (b"" before any)."""
        return PyBytes_FromStringAndSize(<char *>&self.last, 1) if self.relayed else b""


cdef class RelayProtocol:
    """The asyncio protocol of an engine connection (``conn``: the router's
    ``router.connection.Connection``) for the connection's whole life: while a
    :class:`ChunkRelay` has its body (``relay``, set by :meth:`take`) every read goes from the
    event loop straight to the relay, with no Python frame per read; otherwise every read goes
    to ``conn.data_received``. Per relayed read it does what ``Connection.data_received`` does
    with a relay: the read's time (``time.monotonic``'s clock, CLOCK_MONOTONIC) into
    ``conn.last_rx`` and ``conn.home.last_rx`` (the idle timer and the engine's liveness),
    :meth:`ChunkRelay.feed`, and ``conn.relay_settle(result)`` only when the read changed
    something the reader waits for (the body ended or was malformed, the client is full or
    gone, or the reader is already to be woken). The connection's other callbacks go to
    ``conn``. Staying on the transport, instead of being swapped in and out with
    ``set_protocol`` per relayed body, spares the event loop a stop and a restart of reading (two
    ``epoll_ctl`` changes, ~4.5 us per stream; bench/results/long-prompts.md, round 7)."""

    cdef readonly object conn
    cdef object home
    cdef ChunkRelay relay

    def __init__(self, conn, ChunkRelay relay=None):
        self.conn = conn
        self.home = conn.home
        self.relay = relay

    def take(self, ChunkRelay relay):
        """Give the reads to ``relay`` (its body starts with the next read), or back to the
        connection (None)."""
        self.relay = relay
        if relay is not None:
            self.home = self.conn.home

    @property
    def relaying(self):
        """Whether the reads go to a relay now (else to the connection)."""
        return self.relay is not None

    def connection_made(self, transport):
        self.conn.connection_made(transport)

    def data_received(self, bytes data):
        cdef timespec ts
        cdef int st
        cdef ChunkRelay r = self.relay
        conn = self.conn
        if r is None:
            conn.data_received(data)
            return
        clock_gettime(CLOCK_MONOTONIC, &ts)
        t = <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9
        conn.last_rx = t
        if self.home is not None:
            self.home.last_rx = t
        st = r._feed(data)
        if st or r.failed or r.done or conn.held or conn.error is not None:
            conn.relay_settle(st)

    def eof_received(self):
        return self.conn.eof_received()

    def connection_lost(self, exc):
        self.conn.connection_lost(exc)

    def pause_writing(self):
        self.conn.pause_writing()

    def resume_writing(self):
        self.conn.resume_writing()
