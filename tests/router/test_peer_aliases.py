"""SGLang's and vLLM's router conventions as aliases of DPLB's own API (issue 32;
docs/coming-from-sglang-vllm.md): ``/add_worker?url=``, ``/remove_worker?url=``, ``/list_workers``,
``/get_loads``, ``/health_generate``, ``/flush_cache`` fanned out to the engines, ``max_model_len``
in ``/v1/models``. Shapes from sgl-router's ``src/server.rs`` and ``protocols/worker_spec.rs``."""
from __future__ import annotations

import httpx

from bench.fakes import start_fake
from tests.helpers import free_port, wait_until

MODEL = "fake-model"


def test_v1_models_carries_vllm_max_model_len(make_cluster):
    c = make_cluster(2)
    d = httpx.get(c.base + "/v1/models").json()["data"]
    assert [m["id"] for m in d] == [MODEL] and d[0]["max_model_len"] == 4096 and d[0]["root"] == MODEL
    assert httpx.get(c.base + f"/v1/models/{MODEL}").json()["max_model_len"] == 4096


def test_list_workers_get_loads_and_flush_cache_fanned_out(make_cluster):
    c = make_cluster(2)
    lw = httpx.get(c.base + "/list_workers").json()
    assert lw["urls"] == [f.endpoint for f in c.fakes] and [w["id"] for w in lw["workers"]] == [0, 1]
    loads = httpx.get(c.base + "/get_loads").json()
    assert loads["total_workers"] == 2 and [x["worker_id"] for x in loads["loads"]] == [0, 1]
    assert all(x["load"] == 0 for x in loads["loads"])
    r = httpx.post(c.base + "/flush_cache", timeout=60)
    d = r.json()
    assert r.status_code == 200 and sorted(d["successful"]) == sorted(f.endpoint for f in c.fakes), d
    assert d["failed"] == [] and d["total_workers"] == 2 and "Successfully flushed" in d["message"]
    for f in c.fakes:                                   # each engine got its own POST /flush_cache
        assert f.client().stats()["by_path"].get("/flush_cache") == 1


def test_flush_cache_reports_a_failing_engine(make_cluster):
    c = make_cluster(2)
    c.fakes[1].client().set_mode("500")
    r = httpx.post(c.base + "/flush_cache", timeout=60)
    d = r.json()
    assert r.status_code == 502 and d["successful"] == [c.fakes[0].endpoint], d
    assert d["failed"][0][0] == c.fakes[1].endpoint and "answered 5" in d["failed"][0][1]


def test_health_generate_runs_one_token_on_every_ready_worker(make_cluster):
    c = make_cluster(2)
    r = httpx.get(c.base + "/health_generate", timeout=60)
    d = r.json()
    assert r.status_code == 200 and d["status"] == "ok" and sorted(w["id"] for w in d["workers"]) == [0, 1], d
    for f in c.fakes:
        assert f.client().stats()["by_path"].get("/v1/completions") == 1


def test_add_worker_by_url_and_remove_it_like_sglang(make_cluster, procs):
    c = make_cluster(1)
    port = free_port()
    remote = start_fake(procs, None, 0, c.dir, port=port)
    url = f"http://127.0.0.1:{port}"
    r = httpx.post(c.base + "/add_worker", params={"url": url}, timeout=30)
    d = r.json()
    assert r.status_code == 200 and d["message"] == f"Successfully added worker: {url}", r.text
    wid = d["worker_id"]
    assert f"http://127.0.0.1:{port}" in httpx.get(c.base + "/list_workers").json()["urls"]
    wait_until(lambda: any(w["id"] == wid and w["state"] == "ready"
                           for w in httpx.get(c.base + "/dplb/status").json()["workers"]), 20, what="mirror ready")
    r = httpx.post(c.base + "/remove_worker", params={"url": url}, timeout=30)
    assert r.status_code == 200 and r.json()["message"] == f"Successfully removed worker: {url}", r.text
    assert url not in httpx.get(c.base + "/list_workers").json()["urls"]
    r = httpx.post(c.base + "/remove_worker", params={"url": url})
    assert r.status_code == 404
    assert httpx.post(c.base + "/add_worker").status_code == 400          # no ?url=
    del remote
