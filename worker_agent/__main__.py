"""Entry point of ``dplb-worker-agent`` / ``python -m worker_agent``.

Exit codes: 0 clean exit (slot released), 2 bad command line, 1 the segment or socket could not
be set up.
"""
from __future__ import annotations

import asyncio
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run one agent until SIGTERM/SIGINT, return the exit code."""
    from .config import parse_args
    from .errors import ConfigError

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"dplb-worker-agent: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s agent-{cfg.worker_id} %(name)s: %(message)s")
    log = logging.getLogger("worker_agent")

    from dplb_shm import SegmentError, SegmentNotFoundError

    from .agent import Agent

    async def run() -> int:
        try:
            agent = Agent(cfg)
        except (SegmentError, ConfigError) as e:
            hint = (f" (the launch script creates it; an agent started on its own needs `dplb-shm create --name "
                    f"{cfg.shm}` first)") if isinstance(e, SegmentNotFoundError) else ""
            log.error("cannot start: %s%s", e, hint)
            return 1 if isinstance(e, SegmentError) else 2
        try:
            return await agent.run()
        except OSError as e:
            log.error("cannot serve on %s: %s", cfg.uds, e)
            return 1

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(run())
    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
