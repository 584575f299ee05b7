"""Operational scripts (draft-head training, multi-machine launch)."""
