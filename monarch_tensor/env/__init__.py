"""``proc_mesh.env``: read, set and compare environment variables across a mesh's procs.

>>> procs.env.get("CUDA_VISIBLE_DEVICES").get()        # doctest: +SKIP
ValueMesh({'gpus': 2}, ['0', '1'])
>>> procs.env.set("NCCL_DEBUG", "INFO").get()          # doctest: +SKIP
>>> procs.env.list("NCCL_").get().item(gpus=0)         # doctest: +SKIP
{'NCCL_DEBUG': 'INFO'}
>>> print(procs.env.mismatches("NCCL_").get())         # doctest: +SKIP
NCCL_SOCKET_IFNAME: 'eth0' on ranks [0, 1, 2]; 'eth1' on ranks [3]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from ..future import Future
from ..hosts.bootstrap import check_env_name, check_env_values
from ..transport._ports import Collector
from ..transport.mailbox import current_mailbox
from .messages import ReadEnv, WriteEnv


def _learn_roots(procs: list, replies: list) -> None:
    """An ``env.set`` that moved the procs' workspace roots answers where they are now (``_env_proc``): keep
    that for the next sync. Returns None, the value of ``env.set``."""
    from ..workspace_sync import learn_roots

    for p, roots in zip(procs, replies):
        if roots:
            learn_roots(p.addr, roots)


class EnvMismatches(dict):
    """``{name: {value: [ranks]}}`` for every variable whose value is not the same on all ranks.

    A variable missing on some ranks shows up with value ``None`` for those.
    """

    def __str__(self) -> str:
        if not self:
            return "no differences"
        lines = []
        for name, by_value in sorted(self.items()):
            parts = [f"{v!r} on ranks {rs}" for v, rs in sorted(by_value.items(), key=lambda kv: kv[1])]
            lines.append(f"{name}: " + "; ".join(parts))
        return "\n".join(lines)


class ProcEnv:
    """The environment of every proc of a mesh (``proc_mesh.env``); each method returns a ``Future``."""

    def __init__(self, mesh) -> None:
        self._mesh = mesh

    def _call(self, make: Callable, finish: Callable[[list], object], what: str) -> Future:
        try:
            self._mesh._check_alive()
        except Exception as e:  # noqa: BLE001
            return Future.failed(e)
        members = self._mesh._members()
        mailbox = current_mailbox()
        col = Collector([p.addr for p in members], [p.rank for p in members], finish, what)
        port = mailbox.open_port(col)
        for i, p in enumerate(members):
            mailbox.send(p.addr, make(i, port))
        return col.future

    def _values(self, vs: list):
        from ..actor import ValueMesh

        return ValueMesh(self._mesh._shape, vs)

    def get(self, name: str) -> Future:
        """The variable on every rank (``None`` where unset), as a ``ValueMesh``."""
        check_env_name(name)
        return self._call(lambda i, port: ReadEnv((name,), "", port),
                          lambda vs: self._values([v[name] for v in vs]), f"env.get({name!r})")

    def list(self, prefix: str = "") -> Future:
        """``{name: value}`` of the variables starting with ``prefix``, per rank, as a ``ValueMesh``."""
        if not isinstance(prefix, str):
            raise TypeError(f"env.list(prefix): prefix must be a str, got {prefix!r}")
        return self._call(lambda i, port: ReadEnv(None, prefix, port), self._values, f"env.list({prefix!r})")

    def set(self, name: str, value: str | None | Mapping[int, str | None] | list) -> Future:
        """Set ``name`` on every rank (``None`` unsets it); a list or {rank index: value} sets it per rank."""
        check_env_name(name)
        n = len(self._mesh._shape)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"env.set({name!r}, list) needs {n} values (one per rank), got {len(value)}")
            per = list(value)
        elif isinstance(value, Mapping):  # only the ranks named change
            bad = [r for r in value if not (isinstance(r, int) and 0 <= r < n)]
            if bad:
                raise ValueError(f"env.set({name!r}, dict): rank indices {bad} are not in 0..{n - 1}")
            return self._set_some(name, dict(value))
        else:
            per = [value] * n
        check_env_values(per)
        members = self._mesh._members()
        self._moved_roots(name, members)
        return self._call(lambda i, port: WriteEnv({name: per[i]}, port), lambda vs: _learn_roots(members, vs),
                          f"env.set({name!r})")

    def _set_some(self, name: str, values: dict) -> Future:
        check_env_values(values.values())
        mesh = self._mesh
        members = mesh._members()
        mailbox = current_mailbox()
        chosen = [(members[i], v) for i, v in sorted(values.items())]
        self._moved_roots(name, [p for p, _ in chosen])
        col = Collector([p.addr for p, _ in chosen], [p.rank for p, _ in chosen],
                        lambda vs: _learn_roots([p for p, _ in chosen], vs), f"env.set({name!r})")
        port = mailbox.open_port(col)
        for p, v in chosen:
            mailbox.send(p.addr, WriteEnv({name: v}, port))
        return col.future

    @staticmethod
    def _moved_roots(name: str, procs: list) -> None:
        if name in ("WORKSPACE_DIR", "CONDA_PREFIX"):  # where these procs' workspace (or environment) lives
            from ..workspace_sync import forget_roots

            forget_roots([p.addr for p in procs], "" if name == "WORKSPACE_DIR" else name)

    def mismatches(self, prefix: str = "") -> Future:
        """Which variables starting with ``prefix`` differ between ranks: an ``EnvMismatches``."""
        def finish(vs: list) -> EnvMismatches:
            names = sorted(set().union(*(v.keys() for v in vs))) if vs else []
            out = EnvMismatches()
            for name in names:
                by_value: dict = {}
                for rank, env in enumerate(vs):
                    by_value.setdefault(env.get(name), []).append(rank)
                if len(by_value) > 1:
                    out[name] = by_value
            return out

        return self._call(lambda i, port: ReadEnv(None, prefix, port), finish, f"env.mismatches({prefix!r})")
