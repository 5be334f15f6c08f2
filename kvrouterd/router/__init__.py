"""The router: one brain shared by the daemon (``server/``) and the simulator (``sim/``).

It owns the global index, the worker registry and the policy objects, and turns the core
vocabulary (``protocols``) into state changes and decisions. It is synchronous and does no
I/O; hosts call it from one thread (the daemon's event loop, the simulator's loop) and supply
the clock and the random generator.

Every public method validates its input completely before it changes anything, so a call
that raises ``errors.KVRouterError`` leaves the router exactly as it was.

Hosts build the ``Router`` facade (``_router``), which composes one part per job:

- ``events``: engines' Stored / Removed / Cleared batches applied to the index, in sequence;
- ``ledger``: the load ledger (in-flight requests, completions, other replicas' dispatches);
- ``membership``: adding, removing and draining workers, their reported load;
- ``slots``: emptying the slots of cleared and removed workers in steps;
- ``advice``: eviction hints, and a worker's blocks exported to / imported from a peer;
- ``selector``: validating a request and asking the routing policy;
- ``speculative``: routed prompts' blocks counted as cached on events-mode workers until
  their engines' Stored confirms them (or a TTL passes);
- ``policy_table``, ``engine_hashes``, ``access``: the policy objects, the key -> engine hash
  maps hints answer in, and who routed which blocks; ``shared``: what all parts read.
"""

from ._router import Router
from .disagg import PREFILL_HOP_PREFIX, prefill_hop_id
from .events import MAX_KV_GROUPS
from .ledger import PrefixHits, RouteResult, request_bytes
from .settings import RouterSettings
from .slots import DRAIN_STEP_BLOCKS

__all__ = ["DRAIN_STEP_BLOCKS", "MAX_KV_GROUPS", "PREFILL_HOP_PREFIX", "PrefixHits", "RouteResult", "Router",
           "RouterSettings", "prefill_hop_id", "request_bytes"]
