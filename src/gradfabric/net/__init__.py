"""Drivers that run the sans-I/O engines over real sockets."""
