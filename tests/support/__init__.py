"""The test suite's support kit: what test modules share, by job."""
