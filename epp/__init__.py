"""``dplb-epp``: DPLB as the endpoint picker (EPP) of an Envoy gateway.

Envoy (or any gateway of the Gateway API Inference Extension) keeps the data plane; for every
request it opens one ext_proc stream (``envoy.service.ext_proc.v3.ExternalProcessor/Process``) to
this server, which parses the body once (:mod:`router.protocol`), picks a worker with the router's
own scheduler, policies, native kernel and accounting (:mod:`router.scheduling`), and answers with
``x-gateway-destination-endpoint: ip:port`` (header and ``envoy.lb`` dynamic metadata) for Envoy's
``ORIGINAL_DST`` cluster. The response side of the same stream tells the worker's lease the first
content and the end (:mod:`epp.server`).

Modules: :mod:`epp.server` (the ext_proc and health servers, ``/metrics``), :mod:`epp.discovery`
(endpoints from a file, scraped into slots), :mod:`epp.envoy` (an Envoy bootstrap that routes
through this picker), :mod:`epp.__main__` (the command line).
"""
