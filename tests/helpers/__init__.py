"""Helpers shared by the tests: job builders, fixtures, oracles (never a test module)."""
