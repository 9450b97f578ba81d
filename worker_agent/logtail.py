"""The last lines of a log file: the one reader the agent (its engine's log, when the engine dies),
the launcher (a child's log, when it exits or does not start) and the harness quote logs with."""
from __future__ import annotations

import os
from collections import deque
from pathlib import Path


def log_tail(path: Path | str | None, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of the text file ``path``, reading at most ``max_bytes`` from its
    end (undecodable bytes replaced); ``""`` when ``path`` is None or cannot be read."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(deque(data.decode("utf-8", "replace").splitlines(), maxlen=lines))
