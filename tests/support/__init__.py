"""The test suite's support kit: what the test modules share, one module per job (poll, procs, fixtures,
gateway, engine, drive, compose, records, markdown; docs/architecture.md's Tests section says what each holds).
Test modules import their helpers from here, not from one another."""
