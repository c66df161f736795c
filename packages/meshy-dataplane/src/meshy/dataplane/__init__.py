"""Meshy dataplane."""
