"""The runtime's seams toward the layers above it: the tensor engine (``controller/``) and the data plane
(``rdma/``).

The runtime (the transport, procs, actors, hosts and jobs in ``monarch_tensor/``) imports nothing from those
packages: what it needs from them is named here and looked up with ``get(name)``, which imports the layer above
on first use (a script that uses only actors never loads the tensor engine, and a proc loads the data plane
only when a message carries a payload). ``tests/test_layers.py`` checks that no other runtime module imports
them, apart from the public modules that re-export their names (``monarch_tensor.rdma``, Monarch's paths).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, attribute; None for the module itself)
ENTRIES: dict[str, tuple[str, str | None]] = {
    # the tensor engine
    "activate": ("monarch_tensor.controller.api", "activate"),                  # ProcMesh.activate()
    "rank_tensor": ("monarch_tensor.controller.api", "rank_tensor"),            # ProcMesh.rank_tensor()
    "call_actor": ("monarch_tensor.controller.api", "call_actor"),              # an endpoint called with mesh tensors
    "actor_rref": ("monarch_tensor.controller.api", "actor_rref"),              # endpoint.rref()
    "fake_mode": ("monarch_tensor.controller.tensor", "fake_mode"),             # the procs' warm-up
    "RemoteProcessGroup": ("monarch_tensor.controller.process_group", "RemoteProcessGroup"),  # ProcMesh.process_group()
    # the data plane
    "payload": ("monarch_tensor.rdma.payload", None),                           # large buffers of a message (_wire)
    "is_ibverbs_available": ("rdma", "is_ibverbs_available"),
}

_found: dict[str, Any] = {}


def get(name: str) -> Any:
    """The entry ``name`` of ENTRIES, its layer imported on first use."""
    try:
        return _found[name]
    except KeyError:
        pass
    module, attr = ENTRIES[name]
    m = importlib.import_module(module)
    value = _found[name] = m if attr is None else getattr(m, attr)
    return value
