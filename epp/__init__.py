"""``dplb-epp``: DPLB as the endpoint picker (EPP) of an Envoy gateway.

Envoy (or any gateway of the Gateway API Inference Extension) keeps the data plane; for every
request it opens one ext_proc stream (``envoy.service.ext_proc.v3.ExternalProcessor/Process``) to
this server, which goes through the router's own request control (:class:`router.director.Director`:
parse once, model check, admission, a worker picked with the router's scheduler, policies, native
kernel and accounting), and answers with ``x-gateway-destination-endpoint: ip:port`` (header and
``envoy.lb`` dynamic metadata) for Envoy. The response side of the same stream tells the worker's
lease the first content and the end (:mod:`epp.stream`).

Modules, one job each: :mod:`epp.picker` (the picker: the router's state without an HTTP edge,
discovery, readiness, the pick and its fallbacks), :mod:`epp.stream` (the ext_proc stream
handler), :mod:`epp.answers` (the answers it sends), :mod:`epp.observe` and :mod:`epp.handoff`
(the response side on a second, observing filter's stream), :mod:`epp.h2grpc` (ext_proc's gRPC over HTTP/2 framed on the picker's own event loop),
:mod:`epp.server` (the ext_proc, health and ``/metrics`` servers), :mod:`epp.discovery`
(endpoints from a file, scraped into slots), :mod:`epp.kube` (an InferencePool's pods),
:mod:`epp.envoy` (an Envoy bootstrap that routes through this picker), :mod:`epp.__main__` (the
command line).
"""
