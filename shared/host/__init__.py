"""specserve's processes as a host sees them: starting a child service and waiting until it listens
(launch), and what the draft and target services share: common flags, threads, the serving loop
(service_base) and their Prometheus metrics (service_metrics).

May import every other package of `specserve.shared`; never a service.
"""
