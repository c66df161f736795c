"""Meshy infer."""
