"""Type stub of the native stream relay built from csrc/dplb_relay.pyx."""
from collections.abc import Callable

OK: int
CLIENT_FULL: int
CLIENT_GONE: int

class ChunkRelay:
    done: bool
    failed: bool
    extra: bool
    ended: bool
    held_done: bool
    events: int
    relayed: int
    def __init__(self, write: Callable[[bytes], object], client: object, flow: object, carry: bytes = ..., end: bool = ...) -> None: ...
    def feed(self, data: bytes) -> int: ...
    def tail(self) -> bytes: ...
    def last_byte(self) -> bytes: ...
