"""The ready banner (issue 32): it names the policy, and its curl lines work once an API key is set."""
from __future__ import annotations

import io
from pathlib import Path

from launcher.banner import describe_slot
from launcher.gpus import GpuPlan
from launcher.plan import LaunchPlan
from launcher.specs import WorkerPlan
from launcher.supervisor import Supervisor


def banner(**kw) -> str:
    cfg = LaunchPlan(num_workers=1, plan=GpuPlan(num_workers=1, groups=[[]]), engine="sim",
                       run_dir=Path("/tmp/dplb-banner-test"), workers=[WorkerPlan(engine="sim", model="m")], **kw)
    out = io.StringIO()
    sup = Supervisor(cfg, out=out)
    sup.print_banner()
    return out.getvalue()


def test_banner_names_the_policy_from_the_flag_or_the_config():
    assert "policy dplb" in banner()
    assert "policy session" in banner(router_policy="session")
    assert "policy round_robin" in banner(policy="round_robin", router_policy="dplb")


def test_banner_curl_sends_the_key_once_one_is_set():
    plain = banner()
    assert "Authorization" not in plain
    keyed = banner(api_key_set=True)
    chat = next(x for x in keyed.splitlines() if "chat/completions" in x)
    assert '-H "Authorization: Bearer $DPLB_API_KEY"' in chat and "export DPLB_API_KEY" in keyed
    status = next(x for x in keyed.splitlines() if "/dplb/status" in x)
    assert "Authorization" not in status          # open on loopback (docs/api.md "What the API key and the admin token guard")
    wide = banner(api_key_set=True, host="0.0.0.0")
    assert "Authorization" in next(x for x in wide.splitlines() if "/dplb/status" in x)


def test_describe_slot_names_both_pids_and_the_model():
    class S:
        pid, engine_pid, model = 11, 22, "m"

    class Attached:
        pid, engine_pid, model = 11, 0, ""

    assert describe_slot(S()) == "agent pid 11, engine pid 22, model m"
    assert describe_slot(Attached()) == "agent pid 11, engine pid -, model -"
