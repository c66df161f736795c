"""Meshy train."""
