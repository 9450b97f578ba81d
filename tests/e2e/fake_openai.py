"""A tiny OpenAI-compatible server for testing the replayer alone: ``python -m tests.e2e.fake_openai --port P``.

It answers ``max_tokens`` words (one per SSE chunk when streamed, then a usage chunk when
``stream_options.include_usage`` is set), names a rotating worker (0, 1, 2) in
``X-DPLB-Worker-ID``, fails with an OpenAI-shaped 503 when ``max_tokens == 13`` and ends a
stream with an SSE error event when ``max_tokens == 17``.
"""
from __future__ import annotations

import argparse
import itertools
import time

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

app = FastAPI()
_next_worker = itertools.cycle(["0", "1", "2"])


@app.get("/v1/models")
async def models() -> dict:
    return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "test"}]}


async def _complete(request: Request, chat: bool) -> Response:
    body = await request.json()
    n = int(body.get("max_tokens") or 16)
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    hdr = {"X-DPLB-Worker-ID": next(_next_worker)}
    if n == 13:
        return JSONResponse({"error": {"message": "no worker", "type": "service_unavailable", "param": None,
                                       "code": 503}}, status_code=503, headers=hdr)
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": len(prompt.split()) + n}
    obj = "chat.completion" if chat else "text_completion"
    base = {"id": "x", "created": int(time.time()), "model": body["model"]}
    if not body.get("stream"):
        text = " ".join(["tok"] * n)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        return JSONResponse({**base, "object": obj, "choices": [choice], "usage": usage}, headers=hdr)

    async def gen():
        for i in range(n):
            ch = ({"index": 0, "delta": {"content": "tok "}, "finish_reason": None} if chat
                  else {"index": 0, "text": "tok ", "finish_reason": None})
            yield b"data: " + orjson.dumps({**base, "object": obj + (".chunk" if chat else ""), "choices": [ch]}) + b"\n\n"
        if n == 17:
            yield b'data: {"error": {"message": "engine died", "type": "server_error", "code": 500}}\n\n'
            return
        if (body.get("stream_options") or {}).get("include_usage"):
            yield b"data: " + orjson.dumps({**base, "object": obj + (".chunk" if chat else ""), "choices": [],
                                            "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers=hdr)


@app.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _complete(request, True)


@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(request, False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=ap.parse_args().port, log_level="warning")
