"""Fixtures shared by the exporter's test files (defined with the tests that first needed them)."""

from tests.exporter.test_exporter import exporter, recording

__all__ = ["exporter", "recording"]
