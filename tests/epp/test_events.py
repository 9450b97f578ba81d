"""The picker's KV-events index (epp/events.py): the word tokenizer renders a request the way the
simulated engine does (from the router's prompt text), a feed subscribed to an engine's publisher
catches up before it counts as ready and answers which engine holds a prompt's blocks, an index
over a policy answers from the events (and from the policy's own placements while nothing is
subscribed), and the endpoints file names each engine's publisher. ZMQ over ipc:// sockets in a
temporary directory; every socket and thread is closed at the end."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import orjson
import pytest

from dplb_protocol.wire import parse_request
from epp.discovery import EndpointsFileError, parse_endpoints
from epp.events import EventsFeed, EventsIndex, WordTokenizer, install, wanted
from router.policies.prefix_index import PrefixIndex, uncached_tokens
from sim_engine.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    ZmqEventPublisher,
)
from sim_engine.tokenizer import render_chat, token_ids
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question about the cache\nwith a second line " + "w " * 40},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "and a follow up"}]


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dplb-epp-kv-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def router_text(path: str, body: dict) -> str:
    return parse_request(path, orjson.dumps(body)).text


def test_word_tokenizer_renders_the_request_as_the_simulated_engine_does():
    tok = WordTokenizer(1000)
    text = router_text(CHAT, {"model": "m", "messages": MSGS})
    assert tok.words(CHAT, text) == render_chat(MSGS)
    assert tok(CHAT, text) == token_ids(render_chat(MSGS), 1000)
    assert tok.words("", text) == render_chat(MSGS)          # told from the text
    prompt = "user: not a chat\nsecond line"
    assert tok.words("/v1/completions", router_text("/v1/completions", {"model": "m", "prompt": prompt})) \
        == prompt.split()
    with pytest.raises(ValueError):
        WordTokenizer(0)


def _stored_prompt(messages: list, bs: int, vocab: int, first_hash: int) -> BlockStored:
    ids = token_ids(render_chat(messages), vocab)
    n = (len(ids) - 1) // bs
    return BlockStored(list(range(first_hash, first_hash + n)), None, ids[:n * bs], bs, None, "GPU", None)


def test_feed_catches_up_then_names_the_engine_holding_the_prompt(ipc_dir):
    bs, vocab = 4, 1000
    pubs = [ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{ipc_dir}/pub{i}", f"ipc://{ipc_dir}/replay{i}",
                                             buffer_steps=100)) for i in range(2)]
    feed = EventsFeed(bs, WordTokenizer(vocab))
    try:
        # engine 1 stored the conversation's history before the picker started: only its replay has it
        history = MSGS[:3]
        pubs[1].publish([_stored_prompt(history, bs, vocab, 100)])
        feed.sync({3: (pubs[0].last_endpoint, pubs[0].replay_last_endpoint),
                   7: (pubs[1].last_endpoint, pubs[1].replay_last_endpoint)})
        wait_until(feed.caught_up, timeout=60, what="both subscribers' catch-up")
        text = router_text(CHAT, {"model": "m", "messages": MSGS})
        hits, n = feed.match(CHAT, text)
        assert n == len(render_chat(MSGS))
        # the history's full blocks, less the one that holds the history's last token
        assert set(hits) == {7} and hits[7] == (len(render_chat(history)) - 1) // bs * bs
        index = EventsIndex(PrefixIndex(), feed)
        chars = index.match(index.hashes(text))
        assert set(chars) == {7} and index.chunk_chars == 1
        assert uncached_tokens(index, chars, text, n, 7) == pytest.approx(n - hits[7], abs=1)  # type: ignore[arg-type]
        # the engine evicts the first block: nothing after it matches any more
        pubs[1].publish([BlockRemoved([100], "GPU")])
        wait_until(lambda: feed.match(CHAT, text)[0] == {}, timeout=30, what="the eviction")
        # an endpoint dropped from the file: its subscriber goes
        feed.sync({3: (pubs[0].last_endpoint, pubs[0].replay_last_endpoint)})
        assert set(feed.subs) == {3}
    finally:
        feed.close()
        for p in pubs:
            p.close()


def test_a_placement_counts_until_the_engine_stores_it_or_the_bound_passes(ipc_dir):
    bs, vocab = 4, 1000
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay",
                                           buffer_steps=100))
    now = [100.0]
    feed = EventsFeed(bs, WordTokenizer(vocab), pending_s=5.0, clock=lambda: now[0])
    try:
        feed.sync({2: (pub.last_endpoint, pub.replay_last_endpoint)})
        wait_until(feed.caught_up, timeout=60, what="the subscriber's catch-up")
        index = EventsIndex(PrefixIndex(), feed)
        text = router_text(CHAT, {"model": "m", "messages": MSGS})
        hashes = index.hashes(text)
        assert index.match(hashes) == {}
        index.insert(hashes, 2)   # the picker sent it to worker 2: its blocks count there at once
        n = len(render_chat(MSGS))
        assert feed.match(CHAT, text)[0] == {2: (n - 1) // bs * bs}
        now[0] += 5.0             # never stored: gone after the bound
        assert feed.match(CHAT, text)[0] == {}
        index.match(index.hashes(text))
        index.insert(hashes, 2)
        # the engine stores the prompt's blocks, then evicts the first: from the store on the
        # events alone answer, so the eviction is seen before the bound
        pub.publish([_stored_prompt(MSGS, bs, vocab, 100)])
        wait_until(lambda: not feed.pending[2].until, timeout=30, what="the placement stored")
        pub.publish([BlockRemoved([100], "GPU")])
        wait_until(lambda: feed.match(CHAT, text)[0] == {}, timeout=30, what="the eviction")
    finally:
        feed.close()
        pub.close()


def test_a_feed_that_cannot_replay_is_not_caught_up(ipc_dir):
    """No publisher answers the replay socket: the picker must not count as ready."""
    feed = EventsFeed(4)
    try:
        feed.sync({0: (f"ipc://{ipc_dir}/none", f"ipc://{ipc_dir}/none-replay")})
        assert not feed.caught_up()
        assert EventsFeed().caught_up()   # nothing subscribed: nothing to wait for
    finally:
        feed.close()


def test_index_answers_from_the_policy_index_while_nothing_is_subscribed():
    class Policy:
        index = PrefixIndex()

    pol = Policy()
    feed = EventsFeed(4)
    inner = pol.index
    text = "user:" + "x " * 400
    inner.insert(inner.hashes(text), 2)
    assert install(pol, feed) and isinstance(pol.index, EventsIndex)
    assert install(pol, feed)          # already installed
    idx = pol.index
    assert idx.match(idx.hashes(text)) == inner.match(inner.hashes(text)) != {}
    assert idx.chunk_chars == inner.chunk_chars

    class NoIndex:
        pass

    assert not install(NoIndex(), feed)


def test_endpoints_file_names_each_engines_publisher():
    eps = parse_endpoints("- {address: 127.0.0.1:8000, kv_events: tcp://127.0.0.1:5557, "
                          "kv_events_replay: tcp://127.0.0.1:5558}\n- {address: 127.0.0.1:8001}\n", "f.yaml")
    assert eps["127.0.0.1:8000"]["kv_events"] == "tcp://127.0.0.1:5557"
    assert "kv_events" not in eps["127.0.0.1:8001"]
    slots = {"127.0.0.1:8000": 5, "127.0.0.1:8001": 6}
    assert wanted(eps, slots.get) == {5: ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")}
    assert wanted(eps, {}.get) == {}     # no slot yet
    with pytest.raises(EndpointsFileError, match="'kv_events' must be a ZMQ address"):
        parse_endpoints("- {address: 127.0.0.1:8000, kv_events: 5557}\n", "f.yaml")
    with pytest.raises(EndpointsFileError, match="'kv_events_replay' needs 'kv_events'"):
        parse_endpoints("- {address: 127.0.0.1:8000, kv_events_replay: tcp://h:1}\n", "f.yaml")
