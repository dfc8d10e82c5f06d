"""The gateway: the OpenAI API in front of the draft and target services, grouped by job.

http/      the HTTP front end (server, request parsing, SSE, tokenize and detokenize)
engine/    the step loop (core.Engine) and the state it keeps per request
sched/     the decisions, with no I/O: scheduler and plan, SLO classes, routing, admission, policies
perf/      the cost model of a pass (PassCost) and the profile it starts from
backends/  the model services: replica pool, executor of service calls, discovery
obs/       metrics and spans
config.py  every flag of `specserve gateway`

docs/architecture.md walks a request through them.
"""
