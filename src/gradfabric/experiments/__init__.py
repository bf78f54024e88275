"""Typed configs, experiments, the reproduction suite and its report."""
