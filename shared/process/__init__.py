"""What every specserve process needs: config dataclasses that are also flags and environment variables
(settings), OpenTelemetry setup (tracing), port checks (ports), and dying with the parent (lifeline).

Imports nothing else of specserve.
"""
