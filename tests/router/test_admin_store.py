"""The admin store shared by router processes (router/admin_store.py)."""
from __future__ import annotations

import os

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


def test_a_change_that_keeps_the_files_inode_size_and_mtime_is_still_seen(tmp_path) -> None:
    """``os.replace`` frees the old inode and a later save may get it again: same inode, same size,
    same coarse mtime tick. Such a change is still loaded (the bytes are compared, not a stamp)."""
    import os

    a, b = AdminStore(str(tmp_path)), AdminStore(str(tmp_path))
    with a.edit() as s:
        s.drained.add(3)
    assert b.reload_if_changed() and b.drained == {3}
    st = os.stat(a.path)
    with open(a.path, "r+b") as f:             # same inode, same size, mtime put back
        raw = f.read()
        f.seek(0)
        f.write(raw.replace(b"[3]", b"[4]"))
    os.utime(a.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(a.path).st_ino == st.st_ino and os.stat(a.path).st_size == st.st_size
    assert b.reload_if_changed() and b.drained == {4}


def test_a_failed_save_leaves_no_temporary_file_and_the_next_reload_restores_the_file(tmp_path, monkeypatch) -> None:
    a, b = AdminStore(str(tmp_path)), AdminStore(str(tmp_path))
    with a.edit() as s:
        s.drained.add(1)
    with b.edit() as s:
        s.drained.add(2)                       # B's change, re-read by A's edit below
    real_replace = os.replace

    def broken(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError), a.edit() as s:
        s.drained.add(5)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.json", "admin.lock"]
    assert a.reload_if_changed()               # the file's state, not the unsaved one
    assert a.drained == {1, 2} and a.version == b.version
