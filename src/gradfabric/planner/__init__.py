"""Joint data/model parallelism over heterogeneous devices, with online control."""
