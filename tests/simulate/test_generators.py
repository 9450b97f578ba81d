"""The seeded workload generators (issue 29 item 3): determinism, the Mooncake format, prefix sharing
structure, and sizes and rates within the bounds their docstrings state."""
from __future__ import annotations

import json
import os
from collections import Counter
from itertools import pairwise

import pytest

from dplb_trace.mooncake import BLOCK_TOKENS, load_trace
from simulate.cli import main as simulate_main
from simulate.generators import (
    WORKLOADS,
    agentic,
    describe,
    docqa,
    generate,
    main,
    mixed,
    write_jsonl,
)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_bytes_other_seed_differs(name, tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_jsonl(generate(name, 3, 400), a)
    write_jsonl(generate(name, 3, 400), b)
    write_jsonl(generate(name, 4, 400), c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_written_lines_are_the_bundled_trace_format(name, tmp_path):
    reqs = generate(name, 0, 300)
    p = tmp_path / "w.jsonl"
    write_jsonl(reqs, p)
    first = json.loads(p.read_text().splitlines()[0])
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert isinstance(first["timestamp"], int) and first["timestamp"] == 0
    back = load_trace(p)                      # the loader dplb-replay and dplb-simulate use
    assert len(back) == 300
    assert [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in back] == \
        [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in reqs]
    for r in back:
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)     # exactly the blocks it needs
        assert r.input_length + r.output_length <= 131_072                # fits the default context


def test_agentic_turns_extend_the_previous_turn_and_share_the_system_prompts():
    reqs = agentic(seed=0, requests=1500)
    systems = (tuple(range(16)), tuple(range(16, 28)))      # the two agent types' prompt blocks
    seen: dict[tuple[int, ...], int] = {}
    extends = 0
    for r in reqs:
        assert r.hash_ids[:16] == systems[0] or r.hash_ids[:12] == systems[1]
        # the longest earlier prompt whose ids are a prefix of this one's: the previous turn
        prev = max((k for k in range(13, len(r.hash_ids)) if r.hash_ids[:k] in seen), default=None)
        if prev is not None:
            extends += 1
            assert seen[r.hash_ids[:prev]] < r.input_length     # context grew by output + tool result
        seen[r.hash_ids] = r.input_length
    sessions = len(reqs) - extends
    # 4-20 turns per session (mean 12; long contexts end some early), so most requests are follow-ups
    assert 1500 / 20 <= sessions <= 1500 / 4
    d = describe(reqs)
    assert 1.5 <= d["requests_per_s"] <= 3.0 and d["prompt_max"] <= 48_000
    assert d["infinite_cache_hit"] > 0.8


def test_agentic_turn_k_starts_with_turn_k_minus_1_on_one_session():
    reqs = agentic(seed=5, requests=2000, session_rate=0.001)   # sessions far apart: in order
    first = reqs[0]
    session = [r for r in reqs if r.hash_ids[:len(first.hash_ids)] == first.hash_ids]
    assert len(session) >= 4
    for a, b in pairwise(session):
        assert b.hash_ids[:len(a.hash_ids)] == a.hash_ids
        assert b.input_length - a.input_length >= a.output_length + 50    # output + a tool result
        assert b.timestamp_ms - a.timestamp_ms >= 2000                     # think time >= 2 s


def test_docqa_questions_reuse_a_few_long_documents():
    reqs = docqa(seed=0, requests=1500)
    docs = Counter(r.hash_ids[:-1] for r in reqs)      # all but the question's block
    assert len(docs) <= 8
    assert all(d[0] == 0 for d in docs)                # the shared instruction block
    assert all(20_000 <= (len(d) - 1) * BLOCK_TOKENS <= 60_000 for d in docs)
    assert docs.most_common(1)[0][1] > 1500 / 8        # Zipf: the top document is over-asked
    assert len({r.hash_ids[-1] for r in reqs}) == 1500  # every question its own block
    d = describe(reqs)
    assert 0.7 <= d["requests_per_s"] <= 0.9 and d["infinite_cache_hit"] > 0.95


def test_mixed_is_short_chat_and_bursts_of_long_unique_prompts():
    reqs = mixed(seed=0, requests=3000)
    chat = [r for r in reqs if r.hash_ids[0] == 0]
    long = [r for r in reqs if r.hash_ids[0] != 0]
    assert all(BLOCK_TOKENS + 30 <= r.input_length <= BLOCK_TOKENS + 1500 for r in chat)
    assert all(8_000 <= r.input_length <= 48_000 for r in long)
    assert len({b for r in long for b in r.hash_ids}) == sum(len(r.hash_ids) for r in long)   # nothing shared
    assert 0.02 <= len(long) / len(reqs) <= 0.08
    d = describe(reqs)
    assert 2.0 <= d["requests_per_s"] <= 3.6
    # bursts (6/s against 2/s calm): busy 10 s windows hold over twice the mean, calm ones less than it
    per10 = sorted(Counter(int(r.timestamp_ms // 10_000) for r in reqs).values())
    mean = len(reqs) / len(per10)
    assert per10[-1] >= 2 * mean and per10[len(per10) // 10] <= 0.8 * mean


def test_dplb_workload_script_and_simulate_workload(tmp_path, capsys):
    out = tmp_path / "agentic.jsonl"
    assert main(["agentic", "--seed", "2", "--requests", "50", "--out", str(out)]) == 0
    assert "agentic seed 2: requests 50" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 50
    assert main(["agentic", "--requests", "0", "--out", str(out)]) == 2
    js = tmp_path / "sim.json"
    # the written file and --workload give the same run
    for argv in (["--trace", str(out)], ["--workload", "agentic", "--workload-seed", "2"]):
        assert simulate_main([*argv, "--requests", "50", "--engines", "2", "--policy", "dplb", "--progress", "off",
                              "--json-out", str(js)]) == 0
        (row,) = json.loads(js.read_text())
        row.pop("settings")
        if argv[0] == "--trace":
            ref = row
    assert row == ref
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-sim-{os.getpid()}-")]
