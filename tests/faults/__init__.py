"""Fault-injection suite of issues 8, 15 and 27 (``make test-faults`` = ``pytest -m faults tests``).

Every scenario runs real processes on loopback (router, worker agents with sim engines or the fake
workers of ``bench/fakes.py``), injects one fault under bounded traffic and counts each request as
ok / failed honestly / lost (:mod:`bench.faultsuite.load`). Scenario code lives in
:mod:`bench.faultsuite.scen_workers` (1-5) and :mod:`bench.faultsuite.scen_clients` (6-11), re-exported by
:mod:`bench.faultsuite.scenarios`; ``bench/faults.py`` runs the same functions for the report
``bench/results/faults.md``; ``bench/soak.py`` is scenario 12 (not part of ``make test``).

===========================  =====================================================================
test file                    scenarios
===========================  =====================================================================
test_workers_fail.py         1 kill -9 engine / worker, 2 hung worker / engine / long prefill,
                             3 breaker on 500 (not 400/429), 4 all dead + rejoin (socket, TCP)
test_admin_and_streams.py    5 drain/remove/re-add, 6 client disconnect, 7 stream fidelity,
                             8 ties and bursts, 9 router restart
test_input_and_security.py   10 bad input (+ fuzzing), 11 modes, tokens, admin endpoint schemes
test_regressions.py          one test per bug the suite found (named after it)
test_stays_up.py             issue 15, one test per failure (13 crash loop → gave up → admin
                             restart, 14 dead/draining/departed workers in plain sight, 15 one 504
                             on one worker, 16 first-byte vs idle timeout, 17 round robin per
                             model, 18 header limits, 19 admin behind a proxy); scenario code in
                             :mod:`bench.faultsuite.scen_issue15`. The kill -9 "Shows" test is
                             scenario 1 in test_workers_fail.py
test_request_path.py         issue 27, the router's request path: 27.1 in-flight requests retried
                             (kill -9 of an engine / a worker), a query of death, every worker down;
                             27.2 a known model's workers down; 27.8 complete streams counted 200, a
                             disconnect 499; 27.9 framing errors; scenario code in
                             :mod:`bench.faultsuite.scen_request_path`
test_agents_come_back.py     issue 27.5: kill -9 of an agent under a real launch, restarted into its
                             slot and serving again; the dump's ``stale``; scenario code in
                             :mod:`bench.faultsuite.scen_agent_restart`
test_stop_under_traffic.py   issue 27 item 6 (27.6): Ctrl-C of the launcher under streams, no stream
                             ends with ``abort``, refusals are 503 + Retry-After; scenario code in
                             :mod:`bench.faultsuite.scen_stop`
test_remote_workers.py       issue 27.7, 4 x 50 concurrent add/remove cycles of one remote worker
                             (one and two router processes), the mirror owner killed mid-remove;
                             :mod:`bench.faultsuite.scen_remote_admin`
===========================  =====================================================================
"""
