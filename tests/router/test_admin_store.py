"""The admin store shared by router processes (router/admin_store.py)."""
from __future__ import annotations

import pytest

from router.admin_store import AdminStore


def test_another_processes_change_read_by_a_raising_edit_is_still_reloaded(tmp_path) -> None:
    """Process A's admin call re-reads the file under the lock, then fails (a 404 for a worker
    already removed): A's caller applies nothing, so A's next health tick must still load the change
    process B saved just before. CI saw the lost update as a mirror removal that the leading process
    never applied (B's DELETE answered 202 after 10 s)."""
    a, b = AdminStore(str(tmp_path)), AdminStore(str(tmp_path))
    with a.edit() as s:
        s.drained.add(1)
    assert b.reload_if_changed()
    assert not a.reload_if_changed()           # nothing new for A: it saved the file itself
    with b.edit() as s:                        # B's change, which A has not applied
        s.mirrors["10.0.0.2:8000"] = {"weight": 1.0}
    with pytest.raises(LookupError), a.edit():
        raise LookupError("worker 7 was already removed")
    assert a.reload_if_changed()               # the tick loads it again and applies it
    assert a.mirrors == {"10.0.0.2:8000": {"weight": 1.0}} and a.version == b.version
    assert not a.reload_if_changed()


def test_an_edit_that_changes_nothing_saves_nothing(tmp_path) -> None:
    a, b = AdminStore(str(tmp_path)), AdminStore(str(tmp_path))
    with a.edit() as s:
        s.removed.add(3)
    v = a.version
    assert b.reload_if_changed()
    with b.edit() as s:
        s.removed.add(3)                       # already there
    assert b.version == v and not a.reload_if_changed()
