"""Small endpoints that routers and tools call on a worker, in the shapes the real engines use.

* vLLM: ``GET /health``, ``GET /v1/models``, ``GET /load`` → ``{"server_load": N}`` (HTTP generation
  requests in progress), ``POST /tokenize`` → ``{"count", "max_model_len", "tokens", "token_strs"}``,
  ``POST /v1/chat/completions/render`` → ``{"request_id", "model", "token_ids", ...}`` and
  ``POST /v1/completions/render`` → a list of those (vllm-router's cache_aware policy calls both),
  ``GET /metrics`` (see :mod:`sim_engine.metrics`), ``GET /version``.
* SGLang: ``GET /server_info`` and ``/get_server_info`` (server args + ``internal_states``),
  ``GET /model_info`` and ``/get_model_info`` (no ``model_path``: there is no hub model, and SGLang's
  router would try to download a tokenizer for one), ``GET /get_load`` → SGLang's list shape
  ``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`` (``--get-load-format vllm``:
  ``{"load": N}``, what vllm-router's power_of_two policy reads instead).
* Simulator: ``GET /sim/state`` (see :meth:`EngineCore.state`), ``POST /reset_prefix_cache`` (vLLM's
  name) and ``POST /flush_cache`` (SGLang's).
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from sim_engine import __version__
from sim_engine.api import Routes, SimServer, json_response
from sim_engine.errors import InvalidRequestError
from sim_engine.metrics import CONTENT_TYPE, MetricsRenderer
from sim_engine.protocol import (
    check_model,
    load_json,
    parse_chat,
    parse_completion,
    parse_tokenize,
)
from sim_engine.tokenizer import token_ids


def build_peer_router(server: SimServer) -> Routes:
    """Routes for the peer, health, metrics and simulator-state endpoints of ``server``."""
    r = Routes()
    core, cfg = server.core, server.config
    renderer = MetricsRenderer(core, cfg.model, cfg.time_scale)

    @r.get("/health")
    async def health() -> Response:
        """200 with an empty body once the app has started (vLLM)."""
        return Response(status_code=200)

    @r.get("/version")
    async def version() -> Response:
        """``{"version"}``."""
        return json_response({"version": f"sim-{__version__}"})

    @r.get("/v1/models")
    async def models() -> Response:
        """OpenAI model list with the one served model and its ``max_model_len``."""
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": int(server.started),
                        "owned_by": "dplb-sim",
                        "root": cfg.model,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                    }
                ],
            }
        )

    @r.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text, vLLM names (see :mod:`sim_engine.metrics`)."""
        return Response(renderer.render(), media_type=CONTENT_TYPE)

    @r.get("/sim/state")
    async def sim_state() -> Response:
        """:meth:`EngineCore.state` plus simulated time, wall busy/active seconds and /load."""
        st = core.state()
        st.update(
            peer_calls=dict(server.peer_calls),
            sim_time_s=server.runner.now(),
            time_scale=server.runner.time_scale,
            wall_busy_s=server.runner.wall_busy,
            wall_active_s=server.runner.wall_active,
            server_load=server.server_load,
        )
        return json_response(st)

    @r.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Forget unreferenced cached blocks; ``{"reset_blocks": n}``."""
        return json_response({"reset_blocks": core.kv.reset_prefix_cache()})

    @r.post("/flush_cache")
    async def flush_cache() -> Response:
        """SGLang's name for the same (what a router's ``/flush_cache`` fan-out calls)."""
        return json_response({"reset_blocks": core.kv.reset_prefix_cache()})

    @r.get("/load")
    async def load() -> Response:
        """vLLM ``{"server_load": N}``: generation requests in progress."""
        server.peer_calls["load"] += 1
        return json_response({"server_load": server.server_load})

    @r.get("/get_load")
    async def get_load() -> Response:
        """SGLang list shape (or ``{"load": N}`` with ``--get-load-format vllm``)."""
        server.peer_calls["get_load"] += 1
        if server.get_load_format == "vllm":  # vllm-router's power_of_two reads {"load": N}
            return json_response({"load": len(core.running) + len(core.waiting)})
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": len(core.running) + len(core.waiting),
                    "num_waiting_reqs": len(core.waiting),
                    "num_tokens": core.queued_tokens(),
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    def server_info() -> dict:
        return {
            "served_model_name": cfg.model,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": cfg.block_size,
            "max_running_requests": cfg.max_num_seqs,
            "chunked_prefill_size": cfg.max_num_batched_tokens,
            "context_length": cfg.max_model_len,
            "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "time_scale": cfg.time_scale,
            "slowdown": cfg.slowdown,
            "seed": cfg.seed,
            "engine": "dplb-sim-engine",
            "internal_states": [
                {
                    "num_running_reqs": len(core.running),
                    "num_queue_reqs": len(core.waiting),
                    "token_usage": core.kv.usage,
                }
            ],
            "version": f"sim-{__version__}",
        }

    def model_info() -> dict:
        return {
            "served_model_name": cfg.model,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "max_model_len": cfg.max_model_len,
        }

    async def server_info_ep() -> Response:

        server.peer_calls["server_info"] += 1
        return json_response(server_info())

    async def model_info_ep() -> Response:

        server.peer_calls["model_info"] += 1
        return json_response(model_info())

    for path in ("/server_info", "/get_server_info"):
        r.get(path)(server_info_ep)
    for path in ("/model_info", "/get_model_info"):
        r.get(path)(model_info_ep)

    @r.post("/tokenize")
    async def tokenize_ep(request: Request) -> Response:
        """vLLM ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        server.peer_calls["tokenize"] += 1
        body = load_json(await request.body())
        words = parse_tokenize(body)
        return json_response(
            {
                "count": len(words),
                "max_model_len": cfg.max_model_len,
                "tokens": token_ids(words, cfg.vocab_size),
                "token_strs": words if body.get("return_token_strs") else None,
            }
        )

    def _render(words: list[str], max_tokens: int | None, prefix: str) -> dict:
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "model": cfg.model,
            "prompt": " ".join(words),
            "token_ids": token_ids(words, cfg.vocab_size),
            "sampling_params": {
                "max_tokens": max_tokens if max_tokens is not None else core.default_max_tokens(len(words))
            },
        }

    @r.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        """vLLM chat render: the rendered prompt's ``token_ids`` (nothing is run)."""
        server.peer_calls["chat_render"] += 1
        p = parse_chat(load_json(await request.body()), None)  # any model name
        return json_response(_render(p.prompts[0], p.max_tokens, "chatcmpl"))

    @r.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        """vLLM completions render: one ``{"token_ids", ...}`` per prompt."""
        server.peer_calls["completions_render"] += 1
        p = parse_completion(load_json(await request.body()), None)
        return json_response([_render(w, p.max_tokens, "cmpl") for w in p.prompts])

    @r.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """Ids cannot be inverted (crc32 of words): ``<id>`` placeholders."""
        body = load_json(await request.body())
        check_model(body, cfg.model)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise InvalidRequestError("'tokens' must be a list of integers", param="tokens")
        # ids are hashes of words and cannot be inverted: answer with placeholders
        return json_response({"prompt": " ".join(f"<{t}>" for t in toks)})

    return r
