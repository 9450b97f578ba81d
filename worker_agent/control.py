"""The agent's control sockets and server: the sockets bound and listening from the agent's start
(a Unix socket at ``--uds``, TCP with ``--control-port``), the control API's modules imported off
the event loop, and the uvicorn server that serves it once :meth:`worker_agent.agent.Agent` opens
its gate."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


def load_control_modules() -> None:
    """Import what the control API needs (fastapi, starlette, uvicorn and its httptools protocol):
    about half of the agent's start-up imports (0.45 of 1.0 s of CPU; 2-4 s of wall time on a
    2-core machine at load 15; ``python -X importtime -c "import worker_agent.agent"``). The agent
    does it in a thread once its slot no longer waits for it (:meth:`Agent._serve_control`)."""
    import fastapi  # noqa: F401
    import starlette.responses  # noqa: F401
    import uvicorn.protocols.http.httptools_impl  # noqa: F401  (uvicorn's Config.load imports it)


def control_server(app: FastAPI) -> uvicorn.Server:
    """The uvicorn server of the control API ``app`` (HTTP/1.1 with httptools, no lifespan, no
    access log), one that leaves SIGINT/SIGTERM to the agent (drain first, then shut down)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn hook, replaced by a no-op
            yield

    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http="httptools",
                            loop="none", timeout_graceful_shutdown=2, timeout_keep_alive=30, server_header=False,
                            date_header=False)
    return _Server(config)


def bind_unix_socket(path: str, mode: int = 0o660) -> socket.socket:
    """Bind a listening Unix socket at ``path`` with ``mode``, replacing a stale socket file.

    Raises:
        OSError: the path is held by a live listener (``EADDRINUSE``) or cannot be created.
    """
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a leftover from a dead agent
        else:
            raise OSError(98, f"{path} is in use by a running process")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (the control API for remote routers)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock
