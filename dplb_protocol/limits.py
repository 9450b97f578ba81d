"""The limits the router, the worker agent and the launcher share (each passes the same flag).

This module imports nothing from the rest of DPLB.
"""
from __future__ import annotations

#: The drain limit, seconds: how long a stopping worker (DRAINING, or an admin restart) waits for the
#: requests in flight on its engine to end before it stops the engine anyway. The one default of
#: ``--drain-timeout`` for the agent, the router (how long it keeps relaying after SIGTERM) and the
#: launcher (which passes it to both and waits it plus ``launcher.supervisor.STOP_MARGIN_S``).
DRAIN_TIMEOUT_S = 30.0
