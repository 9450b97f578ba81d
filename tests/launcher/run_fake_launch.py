"""``python -m tests.launcher.run_fake_launch <launcher flags>``: the real launcher CLI and supervisor,
with the stand-in agent and router of this folder instead of ``worker_agent`` and ``router``."""
from __future__ import annotations

import sys

from launcher.cli import build_parser, config_from_args, split_engine_args
from launcher.errors import LaunchError
from launcher.supervisor import Supervisor


def main() -> int:
    own, extra = split_engine_args(sys.argv[1:])
    cfg = config_from_args(build_parser().parse_args(own), extra)
    cfg.agent_module = "tests.launcher.fake_agent"
    cfg.router_module = "tests.launcher.fake_router"
    try:
        return Supervisor(cfg).run()
    except LaunchError as e:
        print(f"launch_dplb: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
