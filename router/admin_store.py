"""The admin API's shared state (:class:`AdminStore`): drained and removed workers and the mirrors
added or removed at run time, kept in ``<state_dir>/admin.json`` and shared by every router process
of a deployment under an exclusive ``flock`` on ``<state_dir>/admin.lock`` (:mod:`router.admin`'s
docstring tells the protocol). Plain files and ``orjson``: no web framework, so the router's state
(:mod:`router.state`) and the endpoint picker hold it without FastAPI."""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import TypedDict

import orjson


class MirrorSpec(TypedDict, total=False):
    """A remote worker to mirror into a slot, as the admin API or ``backend_servers`` asks:
    its ``weight`` (1.0 when missing) and the ``model`` it serves (None or missing: the one its agent
    reports); ``engine``: True for a plain engine without a DPLB agent (vLLM, SGLang, any OpenAI
    server), which the router probes and scrapes itself (:meth:`router.mirror.MirrorManager.scrape_one`)."""

    weight: float
    model: str | None
    engine: bool
    #: the engine's KV-cache events publisher and its replay socket (``tcp://host:port``; the
    #: picker's endpoints file, :mod:`epp.events`)
    kv_events: str
    kv_events_replay: str


class AdminStore:
    """The shared admin state: drained ids, removed (local) ids, mirrors added at run time
    (endpoint → spec), configured mirrors removed at run time (``unmirrored``), and ``version``,
    bumped by every change (module docstring)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "admin.json")
        self.lock_path = os.path.join(state_dir, "admin.lock")
        self.state_dir = state_dir
        self.version = 0
        self.drained: set[int] = set()
        self.removed: set[int] = set()
        self.mirrors: dict[str, MirrorSpec] = {}
        self.unmirrored: set[str] = set()
        self._raw: bytes | None = None   # the file as last loaded or saved here

    def _dump(self) -> bytes:
        return orjson.dumps({"version": self.version, "drained": sorted(self.drained), "removed": sorted(self.removed),
                             "mirrors": self.mirrors, "unmirrored": sorted(self.unmirrored)},
                            option=orjson.OPT_SORT_KEYS)

    def save(self) -> None:
        """Write the state atomically (tmp file + rename); callers hold the lock (:meth:`edit`)."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        data = self._dump()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._raw = data

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError:
            return None

    def _load(self, raw: bytes | None = None) -> bool:
        raw = self._read() if raw is None else raw
        if raw is None:
            return False
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(d, dict):
            return False
        self._raw = raw
        self.version = int(d.get("version", 0))
        self.drained = set(d.get("drained", []))
        self.removed = set(d.get("removed", []))
        self.mirrors = dict(d.get("mirrors", {}))
        self.unmirrored = set(d.get("unmirrored", []))
        return True

    def reload_if_changed(self) -> bool:
        """Re-read the file when another process changed it; True when something was loaded.
        Compares the file's bytes (a few KB at most, read once per health tick) with what this process
        last loaded or saved: a stat stamp can miss a change (``os.replace`` frees the inode, the
        next save may get it again, with the same size within one coarse mtime tick), and every
        change bumps ``version``, so equal bytes are the same state."""
        raw = self._read()
        if raw is None or raw == self._raw:
            return False
        return self._load(raw)

    @contextlib.contextmanager
    def edit(self) -> Iterator[AdminStore]:
        """Read-modify-write of the shared state: holds the exclusive lock, re-reads the file,
        yields the store; when the body changed something, bumps ``version`` and saves before the
        lock is dropped. A body that raises saves nothing (it must raise before changing); after it,
        or a failed save, the next :meth:`reload_if_changed` loads the file again: the re-read here
        may have brought in another process's change that the failing caller does not apply, and
        without that reload this process would not apply it until the next change (a mirror
        removal waited out its 10 s).
        The body must not await: the lock blocks every other router process's admin calls."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._load()
            before = self._dump()
            try:
                yield self
                if self._dump() != before:
                    self.version += 1
                    self.save()
            except BaseException:
                self._raw = None         # the next reload_if_changed loads (and the tick applies)
                raise
        finally:
            os.close(fd)
