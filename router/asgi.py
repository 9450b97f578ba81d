"""The ASGI edge's types: the scope, the messages, the receive and send callables, an application.

An ASGI scope or message is a dict whose values' types depend on the key and on the message's
``type`` (the ASGI spec, asgi.readthedocs.io: ``scope["path"]`` a str, ``message["body"]`` bytes,
``scope["extensions"]`` a dict...); uvicorn hands the router plain dicts. These two aliases are the
router's only justified ``Any`` there; everything the router reads from them is narrowed where it
is read. Starlette's ``starlette.types`` spells them the same way.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeAlias

# Any: ASGI scope values are typed by their key (the ASGI spec), not expressible as one value type
Scope: TypeAlias = MutableMapping[str, Any]  # type: ignore[explicit-any]
# Any: ASGI message values are typed by the message's "type" key (the ASGI spec)
Message: TypeAlias = MutableMapping[str, Any]  # type: ignore[explicit-any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send"]
