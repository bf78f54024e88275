"""The emulator: gradfabric's engines as daemons on real UDP sockets, used by
real PyTorch training (``switchd``: the switch daemon; ``client``: a worker's
side of it; ``hook``: DDP communication hooks)."""
