"""The gateway: the OpenAI API in front of the draft and target services, grouped by job.

main.py    the process: wires the parts below and runs them (`specserve gateway`)
http/      the HTTP front end (server, request parsing, SSE, tokenize and detokenize)
frontend/  what a front end asks of the engine: in this process, or from front ends of their own (--frontends)
engine/    the step loops (loop.Engine) and their parts: the request table, intake, admission, draft calls,
           passes, commit
sched/     the decisions, with no I/O: scheduler and plan, SLO classes, routing, admission, policies
perf/      the iteration record, the cost model of a pass (PassCost) and the profile it starts from
backends/  the model services: replica pool, executor of service calls, discovery
obs/       metrics and spans
config.py  every flag of `specserve gateway`

docs/architecture.md walks a request through them.
"""
