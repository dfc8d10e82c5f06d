"""The target service (built in a later issue; see docs/architecture.md)."""
