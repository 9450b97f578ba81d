"""Where ``dplb-epp`` learns its endpoints: a file of engines without agents, scraped into slots.

Three sources, combined (the third, an InferencePool's pods, is :mod:`epp.kube`):

- **A DPLB node's segment** (``--shm NAME``): the agents' slots, as the router reads them.
- **A file of endpoints** (``--endpoints-file FILE``, llm-d-router's "file discovery"): a YAML
  list of ``{address: host:port, model: NAME, weight: W}`` (or ``{endpoints: [...]}``; optionally
  ``kv_events``/``kv_events_replay``: the engine's KV-cache events, :mod:`epp.events`), for engines
  that run without a DPLB agent (vLLM, SGLang or any OpenAI server, on this node or another).
  The file is re-read when its mtime, size or inode changes (polled every health tick; an
  invalid file is logged and the previous list kept). For each address the picker claims a slot
  of its segment (:class:`router.mirror.MirrorManager`'s claiming, slots from the top down) and
  every tick scrapes the engine's Prometheus ``/metrics`` into it, with the agent's parser
  (:func:`worker_agent.metrics.parse_engine_metrics`, vLLM's names, else SGLang's): running,
  waiting, KV-cache usage, and the picker's own in-flight count read at the same scrape (the
  kernel's outside load, ``csrc/dplb_kernel.h``). A page without those families (or no
  ``/metrics`` at all, answered below 500) publishes the picker's in-flight count as the
  engine's running requests, as an agent does before its engine's first metrics. A slot is
  READY after a scrape answered and DEAD after ``max_failures`` failed ones in a row; the router's
  probes (``GET /health``) still decide eligibility. An address dropped from the file gives its
  slot back.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from router.mirror import MirrorManager, engine_metrics

if TYPE_CHECKING:
    from router.admin_store import MirrorSpec

log = logging.getLogger("dplb.epp.discovery")


class EndpointsFileError(ValueError):
    """An endpoints file that cannot be used; the message names the file and the entry."""


def parse_address(addr: object, where: str) -> str:
    """``host:port`` (IPv6 in brackets) checked and returned as given; raises
    :class:`EndpointsFileError` naming
    ``where`` for anything else (Unix sockets included: Envoy's ORIGINAL_DST routes to IP:port)."""
    if not isinstance(addr, str) or not addr:
        raise EndpointsFileError(f"{where}: 'address' must be a string host:port")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointsFileError(f"{where}: address {addr!r} is not host:port (a TCP address Envoy can connect to)")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise EndpointsFileError(f"{where}: address {addr!r}: an IPv6 host goes in brackets, [::1]:8000")
    return addr


def load_endpoints(path: str | os.PathLike[str]) -> dict[str, MirrorSpec]:
    """The endpoints of file ``path``: address → ``{"model": str, "weight": float}`` (in file
    order). Raises :class:`EndpointsFileError` naming the entry (bad YAML, a missing or malformed address, a
    duplicate, a weight that is not a positive number) and OSError when unreadable."""
    return parse_endpoints(Path(path).read_text(), path)


def parse_endpoints(text: str, path: str | os.PathLike[str]) -> dict[str, MirrorSpec]:
    """:func:`load_endpoints` of the file's text (``path`` names it in errors)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EndpointsFileError(f"{path}: not valid YAML: {e}") from None
    if isinstance(raw, dict):
        if "endpoints" not in raw:
            raise EndpointsFileError(f"{path}: expected a list of endpoints (or 'endpoints: [...]')")
        raw = raw["endpoints"]
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise EndpointsFileError(f"{path}: expected a list of endpoints (or 'endpoints: [...]')")
    out: dict[str, MirrorSpec] = {}
    for i, ent in enumerate(raw):
        where = f"{path}: endpoints[{i}]"
        if not isinstance(ent, dict):
            raise EndpointsFileError(f"{where}: expected a mapping with 'address'")
        addr = parse_address(ent.get("address"), where)
        if addr in out:
            raise EndpointsFileError(f"{where}: address {addr} is listed twice")
        model = ent.get("model") or ""
        if not isinstance(model, str):
            raise EndpointsFileError(f"{where}: 'model' must be a string")
        w = ent.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise EndpointsFileError(f"{where}: 'weight' must be a positive number")
        out[addr] = {"model": model, "weight": float(w)}
        for key in ("kv_events", "kv_events_replay"):   # the engine's KV-cache events (epp.events)
            if key in ent:
                if not isinstance(ent[key], str) or "://" not in ent[key]:
                    raise EndpointsFileError(f"{where}: '{key}' must be a ZMQ address (tcp://host:port)")
                out[addr][key] = ent[key]
        if "kv_events_replay" in out[addr] and "kv_events" not in out[addr]:
            raise EndpointsFileError(f"{where}: 'kv_events_replay' needs 'kv_events'")
    return out


class EndpointsFile:
    """A watched endpoints file: :meth:`poll` returns the new list when the file's bytes changed,
    else None (the bytes, not a stat stamp: an editor's save can reuse the inode with the same size
    within one coarse mtime tick; the file is a few KB at most, read once per health tick)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._raw: bytes | None = None     # the bytes last read; None after a failed read
        self._unreadable = False

    def poll(self) -> dict[str, MirrorSpec] | None:
        """Re-read the file if it changed; None when unchanged, missing or invalid (logged once
        per change; the previous list stays in force)."""
        try:
            raw = Path(self.path).read_bytes()
        except OSError as e:
            if not self._unreadable:
                log.warning("endpoints file %s: %s (keeping the previous endpoints)", self.path, e)
                self._unreadable, self._raw = True, None
            return None
        self._unreadable = False
        if raw == self._raw:
            return None
        self._raw = raw
        try:
            eps = parse_endpoints(raw.decode("utf-8"), self.path)
        except ValueError as e:   # EndpointsFileError, UnicodeDecodeError
            log.warning("%s (keeping the previous endpoints)", e)
            return None
        log.info("endpoints file %s: %d endpoint(s)", self.path, len(eps))
        return eps


class ScrapeManager(MirrorManager):
    """Slots for engines without an agent (``wanted``: address → {"model", "weight"}), filled
    from each engine's ``/metrics`` (module docstring). One process of those sharing ``state_dir``
    writes them (the ``scrape.lock`` flock); the others read the slots like any worker's."""

    LOCK = "scrape.lock"
    RECORD = "scrape-slots.json"

    def is_engine(self, endpoint: str) -> bool:
        """Every endpoint of the file is a plain engine: scraped
        (:meth:`router.mirror.MirrorManager.scrape_one`, the router's ``/add_worker?url=`` of an
        engine uses the same)."""
        return True


__all__ = ["EndpointsFile", "EndpointsFileError", "ScrapeManager", "engine_metrics", "load_endpoints", "parse_address",
           "parse_endpoints"]
