"""What Envoy does when the picker cannot be reached (``failure_mode_allow``, GIE's FailOpen /
FailClose): never a hung request. FailClose answers 500 at once; FailOpen lets the request through
without a pick, which the ORIGINAL_DST cluster cannot route (503 ``no healthy upstream``)."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
from launcher.stack import wait_for
from tests.helpers import ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize(("fail_open", "status"), [(False, 500), (True, 503)])
def test_picker_unreachable(procs, run_dir, fail_open, status):
    port, admin = free_port(), free_port()
    cfg = Path(run_dir) / "envoy.yaml"
    # nothing listens on the picker's port
    cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=free_port(),
                                                failure_mode_allow=fail_open, message_timeout_s=5.0)))
    child = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90,
             "Envoy admin /ready", children=[child])
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == status, r.text
    # Envoy's own answer, OpenAI-shaped like the picker's (local_reply_config)
    err = r.json()["error"]
    assert err["code"] == status and err["type"] in ("gateway_error", "upstream_error"), err
