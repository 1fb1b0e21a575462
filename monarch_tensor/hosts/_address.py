"""A host agent's address, in the forms Monarch's ``run_worker_loop_forever`` and ``attach_to_workers``
take: ``tcp://HOST:PORT``; an alias ``tcp://DIAL:PORT@tcp://BIND:PORT`` (listen on BIND, be reached and
named by DIAL: behind NAT, or to listen on every interface, ``0.0.0.0``); either behind a proc id,
``service@tcp://...`` or ``service<2MuAHeDjLCEd>@tcp://...`` (Monarch's proc identity; here an agent has
none, so it is dropped).

>>> split_agent_address("tcp://node7:26600@tcp://0.0.0.0:26600")
('tcp://node7:26600', 'tcp://0.0.0.0:26600')
>>> split_agent_address("service<2MuAHeDjLCEd>@tcp://node7:26600")
('tcp://node7:26600', 'tcp://node7:26600')
"""

from __future__ import annotations

ACCEPTED = ("tcp://HOST:PORT, or Monarch's alias tcp://DIAL_HOST:PORT@tcp://BIND_HOST:PORT (either may follow "
            "a proc id, service@...)")


def split_agent_address(address: str) -> tuple[str, str]:
    """``(dial, bind)``: the address peers reach the agent at, and the one it listens on (the same unless
    ``address`` is an alias). ``ValueError`` naming the accepted forms for anything else; ``ipc://``, which
    Monarch also takes, is refused with the reason."""
    if not isinstance(address, str):
        raise TypeError(f"a host agent's address is a string ({ACCEPTED}), got {address!r}")
    parts = address.split("@")
    if parts and "://" not in parts[0] and len(parts) > 1:  # a proc id (Monarch's ProcAddr form)
        parts = parts[1:]
    if any(p.startswith("ipc://") for p in parts):
        raise ValueError(f"{address!r}: host agents here are reached over CURVE-authenticated TCP, and the "
                         f"procs behind an agent are addressed through its TCP address, so an ipc:// agent "
                         f"address (Monarch's unix sockets) is not served; on one machine use "
                         f"tcp://127.0.0.1:PORT. Accepted: {ACCEPTED}")
    if not 1 <= len(parts) <= 2 or not all(p.startswith("tcp://") for p in parts):
        raise ValueError(f"a host agent's address is {ACCEPTED}; got {address!r}")
    return parts[0], parts[-1]
