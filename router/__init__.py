"""DPLB router: FastAPI/uvicorn front door that scores workers through the shared segment's
native kernel and forwards OpenAI-compatible requests over Unix sockets (TCP for remote agents).

Modules: ``app`` (ASGI app, control endpoints), ``proxy`` (hot path), ``scheduling`` (the one
pipeline), ``policies/`` (one file per policy), ``transport`` (pooled forwarding), ``workers``
(handles/registry), ``health`` (probes), ``breaker``, ``mirror`` (remote workers), ``admin``,
``config``, ``metrics``, ``protocol`` (parsing, prompt length, error bodies, hop-by-hop headers), ``errors``.
"""
