"""`specserve bench`: the load generator (arrivals, workload mix, streamed requests, metrics)."""
