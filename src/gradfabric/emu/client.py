"""A worker's side of a job at a switch daemon, for use from training code.

One import for the clients and what they share:

* ``InaClient`` (``emu.ina``): a rank aggregating through the switch
  (SwitchML, ATP, ESA) or at a parameter server daemon (``ps``); its node
  is native where it is built and suits the job.
* ``OmniClient`` (``emu.attached``): OmniReduce's worker, streaming its
  non-zero blocks to an aggregator daemon (``omni``).
* ``emu.dlcp.DlcpClient``: DLCP's bounded-loss transport.
* ``Ticket`` (``emu.ticket``): what a job's workers were told at
  registration; ``Session`` (``emu.session``): what every client shares (the
  control loop, the float all-reduce, naming whom a stalled collective
  waits on).

``CLIENTS`` is the client class of each scheme a daemon hosts.
"""

from __future__ import annotations

from gradfabric.core.registry import Registry
from gradfabric.emu.attached import Attached as Attached
from gradfabric.emu.attached import Call as Call
from gradfabric.emu.attached import OmniClient
from gradfabric.emu.ina import InaClient
from gradfabric.emu.session import NON_FINITE as NON_FINITE
from gradfabric.emu.session import Agreed as Agreed
from gradfabric.emu.session import Session
from gradfabric.emu.session import block_maxima as block_maxima
from gradfabric.emu.ticket import SWITCH_ENV as SWITCH_ENV
from gradfabric.emu.ticket import Ticket as Ticket
from gradfabric.emu.ticket import fast_retransmit as fast_retransmit
from gradfabric.emu.ticket import parse_address as parse_address
from gradfabric.emu.ticket import scheme_worker as scheme_worker
from gradfabric.emu.ticket import switch_from_env as switch_from_env
from gradfabric.emu.ticket import together as together

__all__ = ["CLIENTS", "InaClient", "OmniClient", "Session"]

# The client class of each scheme a daemon hosts (``emu.dlcp`` adds DLCP's).
CLIENTS: Registry[type[Session]] = Registry("client")
for _name in ("switchml", "atp", "esa", "saatp", "ps"):
    CLIENTS.add(_name, InaClient)
CLIENTS.add("omnireduce", OmniClient)
CLIENTS.alias("omni", "omnireduce")
