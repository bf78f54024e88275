"""The lab: what measures gradfabric, apart from what users import.

Benchmarks and the per-rank training programs of the studies (DDP through
the switch, DLCP, SA-ATP and ESA jobs, sparse tables against TorchRec,
heterogeneous plans executed) and the switch daemon as a process of its own
(``daemon``); their processes start through ``net.launch``. The
studies in ``experiments`` and the ``bench`` commands run them; every run
goes through the library's public code paths (``ina_hook``, the clients,
the daemon), never a copy of them.
"""
