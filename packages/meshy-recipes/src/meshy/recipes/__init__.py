"""Meshy recipes."""
