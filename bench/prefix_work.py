"""The per-byte work of one long prompt, step by step: ``python -m bench.prefix_work [--prompt-bytes N]``.

For chat requests of about ``--prompt-bytes`` bytes (:func:`bench.rawclient.long_prompt_requests`:
20 shared documents, 10/11 of each prompt) over a prefix index that already holds all of them,
prints the median time (ms, ``--repeats`` runs) of each step the router takes per request, native
(:mod:`dplb_prefix`) beside the pure-Python way (the reference :mod:`dplb_prefix.reference` and
``len(s.split())``; Python's ``hash`` over string slices is how the chain was computed before it
went native), and the chain hashes at smaller ``max_chunks`` horizons (is hashing a prefix sample
enough?). Single process, no network: the router's whole CPU per request is
``bench.router_overhead --prompt-bytes``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench.rawclient import long_prompt_requests
from dplb_prefix import PrefixIndex, chain_hashes, count_words
from dplb_prefix.reference import ReferencePrefixIndex
from dplb_protocol.wire import CHAT, parse_request


def _ms(f: Callable[[int], object], repeats: int) -> float:
    xs = []
    for k in range(repeats):
        t0 = time.perf_counter()
        f(k)
        xs.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(xs)


def _python_hash_chain(text: str, model: str | None, c: int = 64) -> list[int]:
    h = 0 if model is None else hash(model)
    out = []
    for i in range(len(text) // c):
        h = hash((h, text[i * c:(i + 1) * c]))
        out.append(h)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_work", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-bytes", type=int, default=220_000)
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args(argv)
    reqs = long_prompt_requests(a.prompt_bytes)
    bodies = [r[r.index(b"\r\n\r\n") + 4:] for r in reqs]
    infos = [parse_request(CHAT, b) for b in bodies]
    n = len(infos)
    native, ref = PrefixIndex(), ReferencePrefixIndex()
    hs = [native.hashes(i.text, i.model) for i in infos]
    rhs = [list(h) for h in hs]
    for k in range(n):
        native.insert(hs[k], k % 4)
        ref.insert(rhs[k], k % 4)
    r = a.repeats
    print(f"{a.prompt_bytes / 1000:g} KB chat prompts ({len(infos[0].text):,} characters, {len(hs[0]):,} chunks of 64), "
          f"index of {len(native):,} entries; median ms of {r} runs")
    rows = [("parse the body (orjson + prompt length)", _ms(lambda k: parse_request(CHAT, bodies[k % n]), r), None),
            ("prompt length: words", _ms(lambda k: count_words(infos[k % n].text), r),
             _ms(lambda k: len(infos[k % n].text.split()), r)),
            ("chain hashes", _ms(lambda k: native.hashes(infos[k % n].text, "bench"), r),
             _ms(lambda k: _python_hash_chain(infos[k % n].text, "bench"), r)),
            ("index match", _ms(lambda k: native.match(hs[(7 * k) % n]), r),
             _ms(lambda k: ref.match(rhs[(7 * k) % n]), r)),
            ("index insert", _ms(lambda k: native.insert(hs[(7 * k) % n], k % 4), r),
             _ms(lambda k: ref.insert(rhs[(7 * k) % n], k % 4), r))]
    print(f"{'step':42s} {'native':>8s} {'Python':>8s}")
    for name, x, y in rows:
        print(f"{name:42s} {x:8.3f} {'-' if y is None else f'{y:8.3f}':>8s}")
    for mc in (64, 256, 1024, 8192):
        print(f"chain hashes, max_chunks {mc:5d} ({min(mc, len(hs[0])) * 64 / 1000:g} KB hashed): "
              f"{_ms(lambda k, mc=mc: chain_hashes(infos[k % n].text, 'bench', 64, mc), r):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
