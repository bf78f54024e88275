"""Model catalog (per-layer parameters and FLOPs) and compute-time model."""
