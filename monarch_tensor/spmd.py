"""torchrun's environment on a proc mesh, so ``torch.distributed.init_process_group()`` works in actors.

Monarch 0.7's ``monarch.spmd.setup_torch_elastic_env`` (also the seeds'
``monarch_tensor.utils.setup_env_for_distributed``): every proc gets
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` (plus torchrun's ``GROUP_*``/``ROLE_*``), so a
torchrun-style training function runs unchanged inside an actor.

>>> procs = this_host().spawn_procs(per_host={"gpus": 4})
>>> setup_torch_elastic_env(procs)
>>> trainers = procs.spawn("trainer", Trainer)   # its endpoints may call init_process_group("gloo")

``SPMDActor`` runs a whole torchrun-style script (or ``-m module``) on every proc, as Monarch's does:

>>> spmd = procs.spawn("spmd", SPMDActor)
>>> addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get()
>>> spmd.main.call(addr, port, ["train.py", "--lr", "0.001"]).get()
"""

from __future__ import annotations

import math
import os
import runpy
import socket
import sys
from collections.abc import Sequence

from .actor import Actor, current_rank, current_size, endpoint
from .env.messages import ReserveMasterPort, WriteEnv
from .future import Future
from .transport._fanout import ROUTE_SEP
from .transport._net import ip_towards
from .transport._ports import Collector
from .transport.mailbox import current_mailbox

TIMEOUT = 60.0


def elastic_env(sizes: dict[str, int], index: int, master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for the ``index``-th proc (row-major) of a mesh of ``sizes``.

    The last dimension is the one within a host (``LOCAL_RANK``), as in Monarch.

    >>> elastic_env({"hosts": 2, "gpus": 4}, 5, "h0", 29500)["LOCAL_RANK"]
    '1'
    """
    world = math.prod(sizes.values()) if sizes else 1
    local_world = list(sizes.values())[-1] if sizes else 1
    group_world = (world + local_world - 1) // local_world
    return {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "RANK": str(index), "LOCAL_RANK": str(index % local_world),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(index // local_world), "GROUP_WORLD_SIZE": str(group_world),
        "ROLE_RANK": str(index), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "rank",
        "TORCHELASTIC_RUN_ID": "monarch-tensor",
    }


def _host_of_proc(addr: str) -> str:
    """The host a proc runs on, by its address: its host agent's (``tcp://HOST:PORT`` of ``tcp://HOST:PORT|...``),
    or ``""`` for this machine's procs (``ipc://...``, spawned here)."""
    return addr.partition(ROUTE_SEP)[0] if ROUTE_SEP in addr else ""


def _towards(addrs: list[str]) -> str | None:
    """Where rank 0 (``addrs[0]``) finds the route to the other hosts of a mesh: the address of a host other
    than its own, or None when every proc runs on rank 0's host (the same host agent, or all on this machine;
    not merely a host of the same name). For this machine, seen from rank 0's host: this process's address
    on the route to that host's agent."""
    home = _host_of_proc(addrs[0])
    for addr in addrs[1:]:
        there = _host_of_proc(addr)
        if there != home:
            return there or ip_towards(home)
    return None


def _master_addr(towards: str | None, hostname: str, routed: str | None) -> str:
    """MASTER_ADDR from rank 0's answer to ``ReserveMasterPort``: loopback when the whole mesh is on rank 0's
    host (it always resolves there); else rank 0's address on the route to another host of the mesh, which
    that host reaches (a name may resolve to loopback, or to another host of the same name); its host name
    only where it found no route."""
    if towards is None:
        return "127.0.0.1"
    return routed if routed not in (None, "0.0.0.0") else hostname


def _setup(proc_mesh, master_addr: str | None, master_port: int | None, use_ipaddr: object = None) -> Future:
    if (master_addr is None) != (master_port is None):
        raise ValueError("give both master_addr and master_port, or neither (rank 0's host and a free port)")
    if master_addr is not None and (not isinstance(master_addr, str) or not master_addr or "\0" in master_addr):
        raise TypeError(f"master_addr must be a host name or address (a str), got {master_addr!r}")
    if master_port is not None and (isinstance(master_port, bool) or not isinstance(master_port, int)
                                    or not 1 <= master_port <= 65535):
        raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
    if not hasattr(proc_mesh, "_check_alive"):
        raise TypeError(f"the torch elastic env is set on a ProcMesh, got {proc_mesh!r}")
    proc_mesh._check_alive()
    members = proc_mesh._members()
    mailbox = current_mailbox()
    if master_addr is None:
        # ``use_ipaddr`` (Monarch's) needs nothing more: a mesh across hosts is given rank 0's address.
        towards = _towards([p.addr for p in members])
        col = Collector([members[0].addr], [members[0].rank], lambda vs: vs[0], "MASTER_PORT")
        port = mailbox.open_port(col)
        mailbox.send(members[0].addr, ReserveMasterPort(port, towards))
        hostname, master_port, routed = col.future.get(timeout=TIMEOUT)
        master_addr = _master_addr(towards, hostname, routed)
    sizes = proc_mesh._shape.sizes
    col = Collector([p.addr for p in members], [p.rank for p in members], lambda vs: None, "torch elastic env")
    port = mailbox.open_port(col)
    for i, p in enumerate(members):
        mailbox.send(p.addr, WriteEnv(elastic_env(sizes, i, master_addr, int(master_port)), port))
    return col.future


def setup_torch_elastic_env(proc_mesh, master_addr: str | None = None, master_port: int | None = None,
                            use_ipaddr: object = None) -> None:
    """Set torchrun's variables on every proc of ``proc_mesh`` (rank 0's host is the master: ``127.0.0.1``
    when the whole mesh runs on that host, else its address on the route to the other hosts)."""
    _setup(proc_mesh, master_addr, master_port, use_ipaddr).get(timeout=TIMEOUT)


async def setup_torch_elastic_env_async(proc_mesh, master_addr: str | None = None, master_port: int | None = None,
                                        use_ipaddr: object = None) -> None:
    """``await`` form of :func:`setup_torch_elastic_env`."""
    await _setup(proc_mesh, master_addr, master_port, use_ipaddr)


class SPMDActor(Actor):
    """Runs a torchrun-style training script on every proc of its mesh (Monarch's ``monarch.spmd.SPMDActor``):
    ``main(master_addr, master_port, ["train.py", *args])`` (or ``["-m", "module", *args]``) sets torchrun's
    variables for this rank (``elastic_env``: the last dim is the one within a host) and runs the script as
    ``__main__``, with ``sys.argv`` set; ``setup_env(...)`` only sets the variables. ``get_host_port()`` on
    one rank picks the master: this host's name (its address with ``use_ipaddr``) and a free port."""

    def __init__(self) -> None:
        self._sizes = dict(current_size())
        self._index = current_rank().rank  # row-major in the mesh it was spawned on

    def _env(self, master_addr: str, master_port: int) -> dict[str, str]:
        if not isinstance(master_addr, str) or not master_addr:
            raise TypeError(f"master_addr must be a host name or address (a str), got {master_addr!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
        return elastic_env(self._sizes, self._index, master_addr, master_port)

    @endpoint
    def get_host_port(self, use_ipaddr: object = None) -> tuple[str, int]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = socket.gethostname()
        if not use_ipaddr:
            return host, port
        addr = socket.gethostbyname(host)
        gateway = current_mailbox().gateway  # (behind a host agent: the way to the controller)
        if addr.startswith("127.") and gateway:  # the name resolves to loopback here: the address other hosts reach
            addr = ip_towards(gateway)
        return addr, port

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> None:
        os.environ.update(self._env(master_addr, master_port))

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        env = self._env(master_addr, master_port)
        # (A str would pass as a sequence of one-character arguments: "train.py" ran as script "t".)
        if script_args is not None and (isinstance(script_args, (str, bytes)) or not isinstance(script_args, Sequence)
                                        or not all(isinstance(a, str) for a in script_args)):
            raise TypeError(f"SPMDActor.main: script_args must be a list of strings, the script and its arguments "
                            f"(['train.py', '--lr', '0.001'] or ['-m', 'module', ...]), got {script_args!r}")
        args = list(script_args or ())
        if not args or (args[0] == "-m" and len(args) < 2):
            raise ValueError(f"SPMDActor.main needs a script path or '-m module' followed by its arguments, "
                             f"got {script_args!r}")
        if args[0] != "-m" and not os.path.isfile(args[0]):
            raise FileNotFoundError(f"SPMDActor.main: no script {args[0]!r} on this proc (cwd {os.getcwd()})")
        os.environ.update(env)
        old_argv = sys.argv
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = args
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as e:  # sys.exit() ends a torchrun script as well: 0 (or None) is success
            if e.code not in (0, None):
                raise RuntimeError(f"{args[0] if args[0] != '-m' else args[1]} exited with {e.code!r}") from None
        finally:
            sys.argv = old_argv
        return True
