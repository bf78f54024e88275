"""gradfabric: distributed DNN training that communicates less and waits less.

One set of sans-I/O protocol engines (``gradfabric.proto``) is driven by a
discrete-event simulator (``gradfabric.sim``), by real UDP sockets
(``gradfabric.net``) and, in later layers, by PyTorch hooks.
"""

__version__ = "0.1.0"
