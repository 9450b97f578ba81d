"""Reading what Redis answers for :mod:`router.share` (redis-py's RESP2 replies: stream entries,
XREAD answers, ids) and printing its URL without the password."""
from __future__ import annotations


def _b(v: object) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _streams_of(got: object) -> list[tuple[object, object]]:
    """An XREAD answer (``[[stream, entries], ...]``: RESP2, redis-py's default protocol) as
    ``[(stream, entries), ...]``, checked."""
    out = []
    for x in got if isinstance(got, list) else ():
        if isinstance(x, (list, tuple)) and len(x) == 2:
            out.append((x[0], x[1]))
    return out


def _entries(raw: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as redis-py answers them (``[(id, {field: value}), ...]``), checked."""
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    if isinstance(raw, list):
        for e in raw:
            if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[1], dict):
                out.append((_b(e[0]), {_b(k): _b(v) for k, v in e[1].items()}))
    return out


def _id_key(eid: bytes) -> tuple[int, int]:
    """A stream entry id as a sortable pair; ``0-0`` and ``$`` (nothing applied yet) sort first."""
    ms, _, seq = eid.partition(b"-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return -1, -1


def _s(v: object) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _int(v: object) -> int:
    try:
        return int(_s(v))
    except ValueError:
        return 0


def _id_ms(eid: bytes | str) -> int:
    """A stream entry id's milliseconds (Redis server time)."""
    return int(_b(eid).split(b"-")[0])


def _safe(url: str) -> str:
    """``url`` without its password."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('//')[0]}//***@{tail}" if at else url


__all__ = ["_b", "_entries", "_id_key", "_id_ms", "_int", "_s", "_safe", "_streams_of"]
