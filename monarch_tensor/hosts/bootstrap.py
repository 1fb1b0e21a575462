"""How procs start: ``spawn_procs(bootstrap_command=...)`` (Monarch's ``BootstrapCommand``: the interpreter and
added environment of the procs) and ``spawn_procs(bootstrap=fn)`` (a function run on every new proc before
the mesh is used)."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
import threading
from typing import TYPE_CHECKING, Mapping

from ..config import setting
from ..future import Future, run_to_end
from ..shape import Shape

if TYPE_CHECKING:
    from .proc_mesh import ProcMesh


# Environment variables that procs start with, and that ``procs.env`` sets (the env tool checks its names
# and values here too).
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env_values(values) -> None:
    """Each of ``values`` is a string without NUL, or None (unset)."""
    for v in values:
        if v is not None and not isinstance(v, str):
            raise TypeError(f"environment values must be str or None, got {v!r}")
        if v is not None and "\0" in v:
            raise ValueError(f"environment values cannot hold a NUL character, got {v!r}")


def check_env_name(name: str) -> None:
    """``name`` is a portable variable name: letters, digits and ``_``, not starting with a digit."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad environment variable name {name!r}: letters, digits and '_', not starting with a digit")


def check_env(env: object, what: str) -> None:
    """``env`` for procs to start with (``proc_mesh(env=...)``): ``{name: value}`` of strings, the names and
    values ``procs.env.set`` takes (POSIX's portable names: a proc could not set ``""``, ``"A=B"`` or a NUL, and
    would die at its start). Checked at the call; ``what`` names it in the error."""
    if env is None:
        return
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"{what} maps variable names to string values, got {env!r}")
    for name in env:
        check_env_name(name)
    check_env_values(env.values())


# How long spawn_procs waits for its bootstrap function on every proc (a proc that dies fails it at once).
BOOTSTRAP_TIMEOUT = setting("MONARCH_TENSOR_BOOTSTRAP_TIMEOUT")


class BootstrapCommand:
    """How a proc starts (Monarch's ``BootstrapCommand(program, arg0, args, env)``), for
    ``spawn_procs(bootstrap_command=...)``. Here procs are forked from a template process that runs
    ``program`` (a Python interpreter, as ``with_python_executable``), and ``env`` is added to each proc's
    environment from its start. A command line of one's own (``args``, an ``arg0`` other than ``program``)
    cannot be honoured, since no proc is exec'd: ``spawn_procs`` refuses it (run setup code with
    ``bootstrap=`` instead)."""

    def __init__(self, program: str, arg0: str | None = None, args: list[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if not isinstance(program, str) or not program:
            raise TypeError(f"BootstrapCommand(program=...) takes the path of a program, got {program!r}")
        if arg0 is not None and not isinstance(arg0, str):
            raise TypeError(f"BootstrapCommand(arg0=...) takes a string or None, got {arg0!r}")
        args = [] if args is None else args
        if not (isinstance(args, (list, tuple)) and all(isinstance(a, str) for a in args)):
            raise TypeError(f"BootstrapCommand(args=...) takes a list of strings, got {args!r}")
        env = {} if env is None else dict(env)
        check_env(env, "BootstrapCommand(env=...)")
        self.program, self.arg0, self.args, self.env = program, arg0, list(args), env

    def with_env(self, env: Mapping[str, str]) -> BootstrapCommand:
        """A copy with ``env`` merged over its environment (Monarch's; this one is unchanged)."""
        check_env(dict(env), "BootstrapCommand.with_env(...)")
        return BootstrapCommand(self.program, self.arg0, self.args, {**self.env, **env})

    def __eq__(self, other) -> bool:
        if not isinstance(other, BootstrapCommand):
            return NotImplemented
        return (self.program, self.arg0, self.args, self.env) == (other.program, other.arg0, other.args, other.env)

    __hash__ = None

    def __repr__(self) -> str:
        return f"BootstrapCommand(program={self.program!r}, arg0={self.arg0!r}, args={self.args!r}, env={self.env!r})"


def default_bootstrap_cmd() -> BootstrapCommand:
    """The command procs start with by default (Monarch's): this interpreter, no arguments of its own, no
    added environment; a base for ``.with_env({...})``."""
    return BootstrapCommand(sys.executable, None, [], {})


def bootstrap_plan(bootstrap_command, shape: Shape, python_exe: str | None,
                   local: bool = True) -> tuple[str | None, list[dict] | None]:
    """``spawn_procs(bootstrap_command=...)`` as this runtime can honour it: the interpreter the procs of
    ``shape`` run and each rank's added environment. A ``BootstrapCommand``, or a function of a proc's
    ``Point`` that returns one (Monarch's per-rank form). Its program replaces ``python_exe`` (the host
    mesh's), except that this interpreter's path (``default_bootstrap_cmd()``'s) on a host mesh with none
    keeps the hosts' default; ``local``: the program must exist here (a job's hosts check it themselves).
    What cannot be honoured is an error that says why, never ignored."""
    if bootstrap_command is None:
        return python_exe, None
    if isinstance(bootstrap_command, BootstrapCommand):
        cmds = [bootstrap_command] * len(shape)
    elif callable(bootstrap_command):
        cmds = [bootstrap_command(shape.point(r)) for r in range(len(shape))]
        bad = next((c for c in cmds if not isinstance(c, BootstrapCommand)), None)
        if bad is not None:
            raise TypeError(f"spawn_procs(bootstrap_command=fn): fn(point) must return a BootstrapCommand, got {bad!r}")
    else:
        raise TypeError(f"spawn_procs(bootstrap_command=...) takes a BootstrapCommand or a function of a Point "
                        f"returning one, got {bootstrap_command!r}")
    programs = sorted({c.program for c in cmds})
    if len(programs) > 1:
        raise ValueError(f"spawn_procs(bootstrap_command=...): every proc of a mesh runs one program here (they fork "
                         f"from one template process), got {programs}; spawn a mesh per program")
    for c in cmds:
        if c.args or (c.arg0 is not None and c.arg0 != c.program):
            raise ValueError(f"spawn_procs(bootstrap_command={c!r}): procs here are forked from a template process "
                             f"that runs the program, so a command line of your own (args, arg0) cannot be run; "
                             f"give BootstrapCommand(program, None, [], env), and run setup code with "
                             f"spawn_procs(bootstrap=fn)")
    program = programs[0]
    if python_exe is None and program == sys.executable:
        program = None
    elif local:
        path = shutil.which(program)
        if path is None:
            raise FileNotFoundError(f"spawn_procs(bootstrap_command=...): no such program {program!r}")
        program = os.path.abspath(path)
    return program, [dict(c.env) for c in cmds]


def check_bootstrap(bootstrap) -> None:
    if bootstrap is not None and not callable(bootstrap):
        raise TypeError(f"spawn_procs(bootstrap=...) takes a function of no arguments to run on every proc, "
                        f"got {bootstrap!r}")


def _bootstrap(fn) -> None:
    """On a proc: ``fn()``; an awaitable it returns runs to its end on a loop of its own (this thread may be
    running the proc's), in this proc's context (``current_rank()``)."""
    result = fn()
    if inspect.isawaitable(result):
        run_to_end(result)


def run_bootstrap(mesh: ProcMesh, bootstrap) -> ProcMesh:
    """Start ``bootstrap`` on every proc of a new ``mesh`` and return the mesh at once, as Monarch does: its
    ``initialized`` resolves once it ran everywhere, and raises its ``ActorError`` if it failed anywhere; so
    does anything done with the mesh first (its use waits for the bootstrap), and a failed mesh is stopped."""
    mesh._bootstrap = bootstrap  # heal_mesh runs it on the new procs too
    if bootstrap is None:
        return mesh
    ran = mesh.execute_async(_bootstrap, bootstrap)
    mesh._init = ran  # (set after the call left: the call itself checked the mesh)

    def failed(f: Future) -> None:
        if f.exception(0) is not None:  # (on the thread that received the reply: the stop goes from another)
            threading.Thread(target=mesh.stop, args=("its bootstrap failed",), daemon=True).start()

    ran.add_done_callback(failed)
    return mesh
