"""The fault-injection harness: a disposable stack, fault scenarios and honest request counting.

Every scenario runs real processes on loopback (router, worker agents with sim engines or the fake
workers of :mod:`bench.fakes`), injects one fault under bounded traffic and counts each request as
ok / failed honestly / lost (:mod:`bench.faultsuite.load`). Scenario code lives in
:mod:`bench.faultsuite.scen_workers` (1-5) and :mod:`bench.faultsuite.scen_clients` (6-11),
re-exported by :mod:`bench.faultsuite.scenarios`. Three users: the pytest suite ``tests/faults``
(``make test-faults``), the report ``bench/faults.py`` (``bench/results/faults.md``) and the soak
``bench/soak.py`` (scenario 12). It lives in ``bench/`` so that an installed DPLB can run the
report and the soak: nothing here imports ``tests/``.
"""
