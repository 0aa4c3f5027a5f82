"""Helpers shared by the tests (programs for child processes live here too)."""
