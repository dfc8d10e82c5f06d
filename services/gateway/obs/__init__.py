"""What the gateway reports: Prometheus metrics and OpenTelemetry spans."""
