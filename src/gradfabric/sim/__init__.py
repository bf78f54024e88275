"""Discrete-event network simulator that drives the sans-I/O engines."""
