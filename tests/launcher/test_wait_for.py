"""One polling loop (issue 28): ``launcher.stack.wait_for`` is the loop; the harness's
``bench.procs.wait_until`` and the tests' ``tests.helpers.wait_until`` only give it their errors and
defaults; one log reader (``worker_agent.logtail.log_tail``); one help formatter."""
from __future__ import annotations

import ast
import inspect
import sys

import pytest

from bench.errors import StartupError
from bench.procs import ProcessSet
from bench.procs import wait_until as bench_wait_until
from launcher.stack import ChildExited, ProcessGroup, WaitTimeout, wait_for
from tests.helpers import wait_until


def _loops(fn) -> int:
    tree = ast.parse(inspect.getsource(fn).lstrip())
    return sum(isinstance(n, (ast.While, ast.For)) for n in ast.walk(tree))


def test_the_other_waits_are_the_launchers_loop():
    import bench.faultsuite.scen_issue15 as scen

    assert _loops(wait_for) == 2          # the loop, and its walk over the children
    assert _loops(bench_wait_until) == 0 and _loops(wait_until) == 0
    assert not hasattr(scen, "wait_until")


def test_timeout_quotes_the_last_error_in_both_spellings():
    def boom() -> bool:
        raise OSError("not yet")

    with pytest.raises(WaitTimeout, match="waiting for thing .*not yet") as ei:
        wait_for(boom, 0.1, "thing", interval=0.01)
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value.last, OSError)
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, 0.05, what="nothing")
    with pytest.raises(StartupError, match="not ready after 0 s .*not yet"):
        bench_wait_until(boom, 0.1, "thing", interval=0.01)


def test_a_child_that_exits_is_named_with_its_log(tmp_path):
    with ProcessGroup(log_dir=tmp_path) as group:
        c = group.start([sys.executable, "-c", "print('bye from the child'); raise SystemExit(3)"], name="quitter")
        with pytest.raises(ChildExited, match="(?s)quitter exited with status 3.*bye from the child") as ei:
            wait_for(lambda: False, 30, "a miracle", interval=0.02, children=[c])
        assert ei.value.child is c
    with ProcessSet(tmp_path / "b") as ps:
        c = ps.start([sys.executable, "-c", "raise SystemExit(4)"], name="quitter2")
        with pytest.raises(StartupError, match="quitter2.*exited with code 4"):
            bench_wait_until(lambda: False, 30, "a miracle", interval=0.02, children=[c])


def test_one_log_reader_and_one_help_formatter(tmp_path):
    import bench.replay
    import launcher.cli
    import launcher.stack
    import worker_agent.agent
    from worker_agent.logtail import log_tail

    assert launcher.stack.log_tail is log_tail and worker_agent.agent.log_tail is log_tail
    assert not hasattr(worker_agent.agent, "file_tail")
    assert bench.replay.DefaultsFormatter is launcher.cli.DefaultsFormatter
    p = tmp_path / "x.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(p, 3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "missing.log") == "" and log_tail(None) == ""
