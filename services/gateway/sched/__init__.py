"""The decisions, no I/O: the scheduler and its plan, SLO classes, routing, admission and the speculation policies."""
