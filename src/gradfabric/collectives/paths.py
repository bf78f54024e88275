"""Every exchange a hook can give a bucket or a table, named once.

``auto_hook`` chooses among them per bucket (and per ``sparse=True`` table);
``state.summary()`` and ``bench ddp``'s ``paths`` count calls by these names
(a table's prefixed ``coo-``).
"""

from typing import Final

DENSE: Final = "dense"  # the ring all-reduce of the whole bucket or table
GATHER: Final = "gather"  # every rank's non-zero blocks or rows to every rank, summed there
SHARDED: Final = "sharded"  # reduce-scatter by block or row owner, then the sums all-gathered
SPARSE: Final = "sparse"  # OmniReduce's block exchange: GATHER or SHARDED, the fewer bytes
ROWS: Final = "rows"  # a tracked table's touched rows all-gathered (``rows_hook``)
INA: Final = "ina"  # through the switch: in-network aggregation

AUTO: Final = (DENSE, SPARSE, INA)  # what ``auto_hook`` scans and chooses per dense bucket
COO: Final = (GATHER, SHARDED, DENSE)  # what it chooses per ``sparse=True`` table
