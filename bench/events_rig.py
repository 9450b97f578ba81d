"""``python -m bench.router_overhead --kv-events``: the router's whole request with the engines'
KV-cache events as its prefix index, beside a peer (smg ``cache_aware``) in front of the same engines.

:class:`EventsRig` replaces the bench's single instant worker with ``--kv-engines`` instant
workers (:mod:`bench.instant_worker`, loopback TCP) that each play a remote node's engine and agent:

* each claims slot 0 of a segment of its own (the remote node's) and serves that slot as
  ``GET /dplb/state``, so DPLB's router mirrors it from its ``backend_servers`` entry, as it would an
  agent on another node (``router.mirror``), and forwards requests straight to it;
* each publishes the KV-cache events a vLLM engine with prefix caching would publish for the
  prompts it is sent (vLLM's wire format, :class:`sim_engine.kv_events.ZmqEventPublisher` on an
  ``ipc://`` socket with a replay socket): the prompt rendered and tokenized as the simulated
  engine does (:func:`sim_engine.tokenizer.render_chat`, :func:`sim_engine.tokenizer.token_ids`:
  one token per word, so a prompt of ``--prompt-bytes 300000`` is about 50,000 tokens), cut into
  blocks of ``--kv-block-size``, and one ``BlockStored`` for the full blocks it did not hold yet
  (chained hashes, nothing evicted). The engine costs nothing on the request path but this.

DPLB's router runs with a config file naming every engine in ``backend_servers`` with its
``kv_events``/``kv_events_replay`` publisher and ``kv_events.enabled``; ``--versus smg`` starts smg
in front of the same engines (``--worker-urls`` all of them); ``--versus baseline`` runs the
``--baseline-dir`` checkout with the same config; ``--versus own-index`` DPLB's router with the
same engines but ``kv_events.enabled`` false (its own prefix index). Everything else (blocks,
rounds, figures) is :func:`bench.router_overhead.versus`'s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim_engine.kv_events import ZmqEventPublisher


class EventsWorker:
    """The KV-cache events of one instant worker's prompts (module docstring): :meth:`on_post`
    takes a request body (JSON bytes, chat or completion), publishes a ``BlockStored`` for its
    full blocks not stored before; ``block_size`` tokens a block, ids below ``vocab_size``."""

    def __init__(self, pub: ZmqEventPublisher, block_size: int, vocab_size: int) -> None:
        self.pub = pub
        self.bs = block_size
        self.vocab = vocab_size
        self.stored: set[int] = set()
        self._ids: dict[tuple[str, str], list[int]] = {}   # long messages' token ids, by (role, content)

    def _message_ids(self, role: str, content: str) -> list[int]:
        from sim_engine.tokenizer import token_ids

        key = (role, content)
        got = self._ids.get(key)
        if got is None:
            got = token_ids([f"<|{role}|>", *content.split(), "<|eot|>"], self.vocab)
            if len(content) > 4096:
                self._ids[key] = got
        return got

    def prompt_ids(self, body: bytes) -> list[int]:
        """The prompt's token ids as the simulated engine renders them (chat: ``<|role|> words
        <|eot|>`` per message, then ``<|assistant|>``)."""
        import orjson

        from sim_engine.tokenizer import render_chat, token_ids

        req = orjson.loads(body)
        msgs = req.get("messages")
        if isinstance(msgs, list):
            if all(isinstance(m, dict) and isinstance(m.get("content"), str) and not m.get("tool_calls") for m in msgs):
                ids: list[int] = []
                for m in msgs:
                    ids += self._message_ids(str(m.get("role")), m["content"])
                return ids + token_ids(["<|assistant|>"], self.vocab)
            return token_ids(render_chat(msgs), self.vocab)
        prompt = req.get("prompt")
        return token_ids(prompt.split(), self.vocab) if isinstance(prompt, str) else []

    def on_post(self, body: bytes) -> None:
        """Publish the prompt's new full blocks (one ``BlockStored``; nothing when all are held)."""
        from sim_engine.kv_events import MEDIUM_GPU, BlockStored

        try:
            ids = self.prompt_ids(body)
        except ValueError:
            return
        bs = self.bs
        parent: int | None = None
        prev: int | None = None   # the parent of the first new block
        new: list[int] = []
        first = -1
        for b in range(len(ids) // bs):
            h = hash((parent, *ids[b * bs:(b + 1) * bs]))
            if first < 0 and h not in self.stored:   # a chain's blocks after a new one are new
                first, prev = b, parent
            if first >= 0:
                new.append(h)
            parent = h
        if new:
            self.stored.update(new)
            self.pub.publish([BlockStored(new, prev, ids[first * bs:(first + len(new)) * bs], bs, None, MEDIUM_GPU, None)])


def serve(shm: str, sock: str, pub_ep: str, replay_ep: str, block_size: int, vocab_size: int) -> None:
    """Run one events-publishing instant worker in this process until killed (module docstring)."""
    import orjson

    from bench import instant_worker as iw
    from dplb_shm import Segment
    from sim_engine.kv_events import KVEventsConfig, ZmqEventPublisher

    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", pub_ep, replay_ep, buffer_steps=10_000))
    ev = EventsWorker(pub, block_size, vocab_size)
    seg = Segment.attach(shm)

    def get(path: bytes) -> bytes | None:
        if path == b"/dplb/state":
            return iw._fixed(orjson.dumps(seg.read_slot(0).to_dict()))
        return None

    iw.POST_HOOK[0] = ev.on_post
    iw.GET_HOOK[0] = get
    iw.serve_worker(shm, sock, 1, 0.0)


def router_config(a: argparse.Namespace, run_dir: str, engines: list[str], pubs: list[tuple[str, str]],
                  enabled: bool, name: str) -> str:
    """Write a router config file for the rig (every engine in ``backend_servers`` with its
    publisher, ``kv_events.enabled`` = ``enabled``, its own state directory) into ``run_dir`` as
    ``<name>.yaml``; returns its path."""
    from launcher.stack import write_router_config

    cfg = {"backend_servers": [{"endpoint": e, "kv_events": p, "kv_events_replay": r}
                               for e, (p, r) in zip(engines, pubs, strict=True)],
           "kv_events": {"enabled": enabled, "block_size": a.kv_block_size, "vocab_size": a.kv_vocab_size},
           "router": {"state_dir": os.path.join(run_dir, f"state-{name}")}}
    return str(write_router_config(os.path.join(run_dir, f"{name}.yaml"), cfg))


def wait_mirrors(port: int, n: int, timeout_s: float = 60.0) -> None:
    """Poll the router on ``port`` until it lists ``n`` workers eligible (every engine mirrored);
    raises SystemExit after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ws = httpx.get(f"http://127.0.0.1:{port}/dplb/status", timeout=5).json()["workers"]
        if sum(1 for w in ws if w.get("eligible")) >= n:
            return
        time.sleep(0.2)
    raise SystemExit("the router did not mirror every engine")


def make_rig(a: argparse.Namespace, Rig: type) -> Any:
    """The :class:`EventsRig` for ``a`` (``--kv-events``); ``Rig``: :class:`bench.router_overhead.Rig`
    (passed in: that module imports this one)."""
    from launcher.stack import free_port, router_argv, wait_for_port

    class EventsRig(Rig):
        """:class:`bench.router_overhead.Rig` with ``--kv-engines`` events-publishing instant
        workers on TCP, each with a segment of its own, mirrored by DPLB's router (module docstring)."""

        def __init__(self, a: argparse.Namespace) -> None:
            from dplb_shm import Segment

            super().__init__(a)
            self.tcp = True
            self.engines = [f"127.0.0.1:{free_port()}" for _ in range(a.kv_engines)]
            self.sock = self.engines[0]
            self.engine_shm = [f"{self.shm}-e{i}" for i in range(a.kv_engines)]
            self.engine_segs = [Segment.create(name, num_slots=2) for name in self.engine_shm]
            self.pubs = [(f"ipc://{self.dir}/kv-{i}", f"ipc://{self.dir}/kv-replay-{i}") for i in range(a.kv_engines)]

        def start_worker(self) -> None:
            a = self.a
            for shm, sock, (pub, replay) in zip(self.engine_shm, self.engines, self.pubs, strict=True):
                self.children.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.events_rig", "--serve", shm, sock, pub, replay,
                     str(a.kv_block_size), str(a.kv_vocab_size)], cwd=self.root, start_new_session=True))
            for sock in self.engines:
                wait_for_port(int(sock.rpartition(":")[2]), timeout=20)

        def config(self, enabled: bool, name: str) -> str:
            """A router config file: every engine in ``backend_servers`` with its publisher."""
            return router_config(self.a, self.dir, self.engines, self.pubs, enabled, name)

        def _router_command(self, peer: str | None, port: int) -> tuple[list[str], str, dict[str, str] | None]:
            a = self.a
            if peer in (None, "baseline", "own-index"):
                conf = self.config(peer != "own-index", peer or "dplb")
                argv = router_argv(port=port, shm=self.shm, policy=a.policy, log_level="warning", config=conf)
                if peer == "baseline":
                    if not a.baseline_dir:
                        raise SystemExit("--versus baseline needs --baseline-dir")
                    return argv, a.baseline_dir, {**os.environ, "PYTHONPATH": os.path.abspath(a.baseline_dir)}
                return argv, self.root, None
            from bench.peers import ensure_peer, peer_command

            ensure_peer(peer)
            return (peer_command(peer, a.peer_policy, port, free_port(), [f"http://{e}" for e in self.engines]),
                    self.root, None)

        def launch(self, peer: str | None, log: str) -> tuple[int, int]:
            port, pid = super().launch(peer, log)
            if peer in (None, "baseline", "own-index"):
                self._wait_mirrors(port)
            return port, pid

        def _wait_mirrors(self, port: int) -> None:
            wait_mirrors(port, len(self.engines))

        def close(self) -> None:
            import dplb_shm

            super().close()
            for seg, name in zip(self.engine_segs, self.engine_shm, strict=True):
                seg.close()
                dplb_shm.unlink(name, missing_ok=True)

    return EventsRig(a)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--kv-events`` case's flags on :func:`bench.router_overhead.build_parser`'s parser."""
    ap.add_argument("--kv-events", action="store_true", help="engines that publish KV-cache events, DPLB's router "
                    "with kv_events.enabled (bench/events_rig.py)")
    ap.add_argument("--kv-engines", type=int, default=4, help="engines of --kv-events (default 4)")
    ap.add_argument("--kv-block-size", type=int, default=16, help="their KV block size in tokens (default 16)")
    ap.add_argument("--kv-vocab-size", type=int, default=128_256, help="their vocabulary (default 128256)")


def main(argv: list[str] | None = None) -> int:
    """``--serve SHM SOCK PUB REPLAY BLOCK_SIZE VOCAB``: one events-publishing instant worker."""
    ap = argparse.ArgumentParser(prog="python -m bench.events_rig")
    ap.add_argument("--serve", nargs=6, required=True, metavar=("SHM", "SOCK", "PUB", "REPLAY", "BS", "VOCAB"))
    a = ap.parse_args(argv)
    shm, sock, pub, replay, bs, vocab = a.serve
    serve(shm, sock, pub, replay, int(bs), int(vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
