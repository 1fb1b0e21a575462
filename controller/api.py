"""The tensor engine's public functions, gathered from the modules of their concerns: mesh activation
(``activation``), fetching values (``fetching``), collectives (``collectives``), placing and moving tensors
(``moving``), streams (``streams``), remote functions (``remote_functions``) and actor calls with mesh tensors
(``actor_calls``). Import from here (or ``monarch_tensor``); the modules of the package import each other.

>>> procs = this_host().spawn_procs(per_host={"gpus": 2})
>>> with procs.activate():
...     x = torch.ones(4) + procs.rank_tensor("gpus")
...     y = x.reduce("gpus", "sum")
...     print(fetch_shard(y, gpus=0).result())
tensor([3., 3., 3., 3.])
"""

from __future__ import annotations

from .activation import activate, client_for, ctx_for, get_active_mesh, no_mesh, rank_tensor, worker_stats
from .actor_calls import EXECUTOR, actor_rref, call_actor
from .collectives import reduce, reduce_
from .fetching import fetch_shard, inspect, preview, show
from .moving import RECV_TIMEOUT, shard_batch, slice_mesh, to_mesh
from .remote_functions import Remote, call_on_shard_and_fetch, remote
from .streams import Borrow, Stream, get_active_stream

__all__ = [
    "EXECUTOR", "RECV_TIMEOUT", "Borrow", "Remote", "Stream", "activate", "actor_rref", "call_actor",
    "call_on_shard_and_fetch", "client_for", "ctx_for", "fetch_shard", "get_active_mesh", "get_active_stream",
    "inspect", "no_mesh", "preview", "rank_tensor", "reduce", "reduce_", "remote", "shard_batch", "show",
    "slice_mesh", "to_mesh", "worker_stats",
]
