"""Shared foundations: errors, units, registries, trace sinks."""
