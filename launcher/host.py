"""The host checks a launch makes before it starts anything, and the probes it polls while it waits:
who owns the run dir and the segment name (``flock``), a free port, socket paths that fit
``sun_path``, room in ``/dev/shm`` for the segment, stale sockets removed; ``GET`` probes of the
router and of Envoy's admin API. Each check raises :class:`launcher.errors.UsageError` (exit
status 2) naming what and why; the probes never raise.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import orjson

from launcher.errors import LaunchError, UsageError

if TYPE_CHECKING:
    from dplb_shm import Segment

SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


def lock_dir() -> Path:
    """Where the segment-name locks live: ``$XDG_RUNTIME_DIR/dplb-locks``, else ``/tmp/dplb-locks``."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "dplb-locks"


def take_lock(path: Path, what: str) -> TextIO:
    """Take an exclusive, non-blocking ``flock`` on ``path`` (created, parents too) and write this
    pid into it; returns the open file, which holds the lock until closed or the process exits
    (the descriptor is not inherited by children). Raises :class:`UsageError` naming ``what`` and
    the holder's pid when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")  # noqa: SIM115 - held open for the launcher's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise UsageError(f"{what} belongs to a running DPLB launch (pid {pid}); stop it first, or start "
                             f"this one on another --port (and --run-dir)") from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()   # its owner unlinked it on the way out (release_lock) before we locked: open it anew
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def release_lock(f: TextIO) -> None:
    """Unlink a lock file :func:`take_lock` returned, then close it (unlinked while still held, so
    a launch that opened it meanwhile sees it gone and opens the path afresh)."""
    try:
        os.unlink(f.name)
    except OSError:
        pass
    f.close()


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UsageError` when ``host:port`` cannot be bound (another router runs there)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"port {port} on {host} is not free ({e.strerror}); is another DPLB running? "
                             f"Choose another with --port") from None


def segment_bytes(num_slots: int) -> int:
    """Size in bytes of a segment of ``num_slots`` slots: the 128-byte header plus 1,536 bytes per
    slot (``DPLB_HEADER_SIZE + num_slots * DPLB_SLOT_SIZE``, csrc/dplb_shm.h; 98,432 B for 64)."""
    from dplb_shm.layout import HEADER_SIZE, SLOT_SIZE

    return HEADER_SIZE + num_slots * SLOT_SIZE


def check_shm_space(shm_dir: Path, name: str, num_slots: int) -> None:
    """Raise :class:`UsageError` when ``shm_dir`` (``/dev/shm``) has less free space than the segment
    ``name`` of ``num_slots`` slots needs (:func:`segment_bytes`), counting the space of a stale
    segment of the same name that the launch replaces. The message names ``--shm-size``.

    Why before creating it: tmpfs accepts an ``ftruncate`` past its limit (the file is sparse), and
    the first write to a page beyond it kills the writer with SIGBUS, an error that names nothing.
    A container's ``/dev/shm`` is 64 MB unless ``--shm-size`` says otherwise, and the engines
    (NCCL, PyTorch's worker processes) share it. Nothing is checked when ``shm_dir`` cannot be
    read (no ``/dev/shm``: creating the segment then fails with its own error)."""
    need = segment_bytes(num_slots)
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    try:
        free += os.stat(shm_dir / name).st_blocks * 512   # the stale segment we unlink first
    except OSError:
        pass
    if free >= need:
        return
    total = st.f_blocks * st.f_frsize
    raise UsageError(
        f"{shm_dir} has {_kib(free)} free of {_kib(total)}, but the segment {name} needs {_kib(need)} "
        f"({num_slots} slots x 1536 B + 128 B header); give the container a larger /dev/shm: "
        f"docker/podman run --shm-size=1g (compose: shm_size: 1g; the engines use /dev/shm too), "
        f"or free space in {shm_dir}")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1048576:.1f} MiB"


def prepare_run_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) and remove stale ``*.sock`` files; logs are kept and appended to."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    remove_sockets(path)


def remove_sockets(path: Path) -> None:
    """Delete every ``*.sock`` in ``path`` (sockets of this launch's agents and engines)."""
    try:
        for p in path.glob("*.sock"):
            try:
                p.unlink()
            except OSError:
                pass
    except OSError:
        pass


def envoy_cluster_hosts(admin_url: str, cluster: str, timeout_s: float = 1.0) -> int:
    """How many hosts Envoy's cluster ``cluster`` holds now, from the admin API's
    ``GET /clusters?format=json`` (``cluster_statuses[].host_statuses[]``); 0 when the admin API
    does not answer, answers something else, or has no such cluster. Never raises."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(admin_url + "/clusters?format=json", timeout=timeout_s) as r:
            doc = orjson.loads(r.read())
        for c in doc.get("cluster_statuses") or []:
            if c.get("name") == cluster:
                return len(c.get("host_statuses") or [])
    except (urllib.error.URLError, OSError, ValueError, AttributeError, TypeError):
        pass
    return 0


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 (no proxy, loopback only in practice)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def check_socket_paths(run_dir: Path, num_workers: int) -> None:
    """Raise :class:`UsageError` when the longest socket path of the run dir (the last worker's
    engine socket) does not fit ``sun_path`` (:data:`SUN_PATH_MAX` bytes)."""
    longest = run_dir / f"engine-{num_workers - 1}.sock"
    if len(os.fsencode(longest)) > SUN_PATH_MAX:
        raise UsageError(f"run dir {run_dir} is too long for Unix socket paths ({longest} > "
                         f"{SUN_PATH_MAX} bytes); set DPLB_RUN_DIR to a shorter directory")


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns (the slots' clock)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def segment_class() -> type[Segment]:
    """The segment library's :class:`dplb_shm.Segment`; raises :class:`LaunchError` naming
    ``make install`` when the extension cannot be imported."""
    try:
        from dplb_shm import Segment
    except ImportError as e:
        raise LaunchError(f"cannot import the segment library dplb_shm ({e}); run `make install`") from None
    return Segment
