"""``dplb-simulate``: the whole DPLB cluster in virtual time (issue 12).

N simulated engines (:class:`sim_engine.engine.EngineCore`, the model behind ``dplb-sim-engine``),
one worker agent per engine (the real :class:`worker_agent.agent.Agent` accounting: in-flight,
queued prompt tokens, latency windows, the periodic publication of the engine's running / waiting /
KV usage) and one router (the real :class:`router.scheduling.Scheduler`, the policy objects from
:func:`router.policies.build_policy`, the native kernel reading a private segment), driven by an
event queue in simulated seconds: a full trace runs as fast as the CPU allows.

Modules:

* :mod:`simulate.workload`: Mooncake / Azure traces; what the router, the agent and the engine see
  for each trace line (the text ``dplb-replay`` sends, the engine's block hashes);
* :mod:`simulate.cluster`: the event loop (:class:`~simulate.cluster.Simulation`) and its information
  model (what is published when);
* :mod:`simulate.settings`: what a run is given (:class:`~simulate.settings.SimSettings`, the SLOs)
  and returns (:class:`~simulate.settings.RunResult`); :mod:`simulate.virtual`: the cluster's parts
  (virtual clock, private segment, engines with their agents, the oracle prefix index);
* :mod:`simulate.stats`: the figures of a run (definitions, units: seconds);
* :mod:`simulate.capacity`: goodput by bisection, fewest engines; :mod:`simulate.early_abort`:
  when a run may stop early (a p99 SLO certainly missed, an attainment target out of reach);
* :mod:`simulate.report`: table, JSON, plots, progress bar;
* :mod:`simulate.cli`: the ``dplb-simulate`` command; :mod:`simulate.bench`: ``make bench-simulate``;
* :mod:`simulate.fidelity`: the same window through the live stack and the simulator.
"""
