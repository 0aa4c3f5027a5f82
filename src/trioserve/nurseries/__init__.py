"""Actors and process supervision: trio, no torch."""
