"""The step loop (core.Engine) and what it tracks per request: its iteration record, drafting ahead, preemption."""
