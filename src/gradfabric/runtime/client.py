"""A worker's side of a job at a switch daemon, for use from training code.

One import for the clients and what they share:

* ``InaClient`` (``runtime.ina``): a rank aggregating through the switch
  (SwitchML, ATP, ESA) or at a parameter server daemon (``ps``); its node
  is native where it is built and suits the job.
* ``OmniClient`` (``runtime.attached``): OmniReduce's worker, streaming its
  non-zero blocks to an aggregator daemon (``omni``).
* ``runtime.dlcp.DlcpClient``: DLCP's bounded-loss transport.
* ``Ticket`` (``runtime.ticket``): what a job's workers were told at
  registration; ``Session`` (``runtime.session``): what every client shares (the
  control loop, the float all-reduce, naming whom a stalled collective
  waits on).

``CLIENTS`` is the client class of each scheme a daemon hosts.
"""

from __future__ import annotations

from gradfabric.core.registry import Registry
from gradfabric.runtime.attached import Attached as Attached
from gradfabric.runtime.attached import Call as Call
from gradfabric.runtime.attached import OmniClient
from gradfabric.runtime.ina import InaClient
from gradfabric.runtime.session import NON_FINITE as NON_FINITE
from gradfabric.runtime.session import Agreed as Agreed
from gradfabric.runtime.session import Session
from gradfabric.runtime.session import block_maxima as block_maxima
from gradfabric.runtime.ticket import SWITCH_ENV as SWITCH_ENV
from gradfabric.runtime.ticket import Ticket as Ticket
from gradfabric.runtime.ticket import fast_retransmit as fast_retransmit
from gradfabric.runtime.ticket import parse_address as parse_address
from gradfabric.runtime.ticket import scheme_worker as scheme_worker
from gradfabric.runtime.ticket import switch_from_env as switch_from_env
from gradfabric.runtime.ticket import together as together

__all__ = ["CLIENTS", "InaClient", "OmniClient", "Session"]

# The client class of each scheme a daemon hosts (``runtime.dlcp`` adds DLCP's).
CLIENTS: Registry[type[Session]] = Registry("client")
for _name in ("switchml", "atp", "esa", "saatp", "ps"):
    CLIENTS.add(_name, InaClient)
CLIENTS.add("omnireduce", OmniClient)
CLIENTS.alias("omni", "omnireduce")
