"""What users deploy: gradfabric's engines as a switch daemon on real UDP
sockets, and the clients real PyTorch training sums through. ``switchd``
(the daemon), ``control`` (its control plane), ``metrics``, ``impair``;
``client`` (one import for the clients: ``ticket``, ``session``, ``ina``'s
``InaClient``, ``attached``'s OmniReduce client), ``dlcp`` (DLCP's client)
and ``hook`` (the DDP communication hooks). The emulated cluster is this
runtime on network namespaces, not a model of it."""
