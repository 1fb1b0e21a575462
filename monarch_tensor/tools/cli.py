"""Monarch's ``monarch.tools.cli``: the job commands as argparse sub-commands, one class each.

>>> from monarch_tensor.tools.cli import get_parser, main
>>> args = get_parser().parse_args(["exec", "--per-host", "gpus=4", "nvidia-smi"])
>>> args.func(args)                              # runs it on the current job (exits with its status)
>>> main(["context", "ls"])                      # as ``monarch-tensor context ls``

Each class has ``add_arguments(subparser)`` and ``run(args)`` (Monarch's shape). ``run`` calls the functions
of ``monarch_tensor.tools.commands``; a command that fails exits with its status, and an error of the job
(a bad spec, a host that fails) is one line on stderr and exit status 2. The ``monarch-tensor`` command
(``monarch_tensor.cli``) runs the same commands. ``dashboard`` is Monarch's relay of Meta's MAST
dashboards: as in Monarch's open-source build, it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .. import actor as _actor
from ..actor import shutdown_context
from ..errors import ActorError, DeviceMeshError, JobKeyError, JobStartError, SyncError
from .commands import (
    DEFAULT_JOB_PATH,
    apply_job,
    context_create,
    context_ls,
    context_rm,
    context_use,
    current_context,
    current_spec,
    exec_argv,
    exec_on_job,
    kill,
    load_current_job,
    parse_per_host,
    shell_on_job,
)

__all__ = ["ApplyCmd", "ContextCmd", "DashboardCmd", "DebugCmd", "ExecCmd", "KillCmd", "ShellCmd", "get_parser",
           "main"]

_DEFAULT_DASHBOARD_PORT = 8265

# What a job command reports in one line (status 2) instead of a traceback: the user's input or the job was wrong.
_JOB_ERRORS = (FileNotFoundError, ValueError, TypeError, ImportError, AttributeError, IndexError, KeyError,
               JobStartError, JobKeyError, SyncError, ActorError, DeviceMeshError, TimeoutError, RuntimeError)


def _run(name: str, fn: Callable[[], int | None]) -> None:
    """Run a command: its nonzero status, or 2 with one line on stderr for a job error, ends the process."""
    # A proc of ours that dies fails what waits on it, which reports it here in one line: the default hook
    # would end this process first, with its own message.
    _actor.unhandled_fault_hook = lambda failure: None
    try:
        rc = fn()
    except KeyboardInterrupt:
        from ..job.exec import interrupt_commands

        interrupt_commands()  # (their threads stop the procs, and the commands with them)
        print(f"monarch-tensor {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except _JOB_ERRORS as e:
        text = str(e).splitlines()[0] if str(e) else repr(e)
        print(f"monarch-tensor {name}: {text}", file=sys.stderr)
        sys.exit(2)
    if isinstance(rc, int) and rc:
        sys.exit(rc)


class DebugCmd:
    """``debug``: the ``monarch_dbg>`` prompt of a script paused at ``breakpoint()`` on this machine."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("--host", type=str, default=None,
                               help="Monarch's TCP debug server host: refused here (the script's debug server "
                                    "is found on this machine, by --pid)")
        subparser.add_argument("--port", type=int, default=None, help="Monarch's TCP debug server port: refused here")
        subparser.add_argument("--pid", type=int, default=None, help="the script's process id (default: the newest)")
        subparser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a script to pause")

    def run(self, args: argparse.Namespace) -> None:
        if args.host is not None or args.port is not None:
            raise SystemExit("monarch-tensor debug: --host/--port name Monarch's TCP debug server; here each "
                             "script serves its debugger on a local socket: run `debug` on the script's machine "
                             "(--pid PID picks the script)")
        from ..debugger import _cli as debug_cli

        _run("debug", lambda: debug_cli.main(args.pid, args.wait))


class ApplyCmd:
    """``apply [module.attr]``: start the job of a spec, or reattach to it."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("module_path", nargs="?", default=None, type=str,
                               help="dotted path to a job object (e.g. myjob.job); default: the current "
                                    "context's recorded spec")

    def run(self, args: argparse.Namespace) -> None:
        def apply() -> int:
            seconds = apply_job(args.module_path)
            print(f"Job {load_current_job().__class__.__name__} of {current_spec()} is ready ({seconds:.1f} s); "
                  f"context {current_context()!r}, job file {DEFAULT_JOB_PATH}")
            return 0

        _run("apply", apply)


class ExecCmd:
    """``exec [--all | --mesh NAME | --one | --point DIM=N,...] cmd ...``: run a command on the job's hosts."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        target = subparser.add_mutually_exclusive_group()
        target.add_argument("--all", action="store_true", default=False, dest="run_all",
                            help="every host of every mesh; output to per-rank files")
        target.add_argument("--mesh", type=str, default=None, metavar="NAME",
                            help="every host of mesh NAME; output to per-rank files")
        target.add_argument("--one", action="store_true", default=False,
                            help="rank 0 of the first mesh, output streamed here (the default)")
        target.add_argument("--point", type=str, default=None, metavar="DIM=N,DIM=N",
                            help="one host of the first mesh, e.g. --point hosts=1; output streamed")
        subparser.add_argument("--per-host", type=str, default=None, metavar="DIM=N", dest="per_host",
                               help="N procs per host along DIM (each gets MONARCH_RANK_<DIM>, MONARCH_SIZE_<DIM>)")
        subparser.add_argument("-e", "--env", action="append", default=[], help="KEY=VALUE (repeatable)")
        subparser.add_argument("--workdir", type=str, default=None, help="working directory on the hosts")
        subparser.add_argument("--kill", action="store_true", default=False, help="kill the job after the command")
        subparser.add_argument("--script", type=str, default=None, help="a bash script to run (- : from stdin)")
        subparser.add_argument("-m", dest="module", default=None, metavar="MODULE",
                               help="run a Python module, as python -m")
        subparser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")

    def run(self, args: argparse.Namespace) -> None:
        cmd = exec_argv(args.cmd, args.module)
        if not cmd and args.script is None:
            print("Error: no command specified (use cmd args or --script)", file=sys.stderr)
            sys.exit(1)
        _run("exec", lambda: exec_on_job(cmd, run_all=args.run_all, mesh_name=args.mesh, point_str=args.point,
                                         env=args.env or None, workdir=args.workdir, kill=args.kill,
                                         script=args.script, per_host=parse_per_host(args.per_host)))


class ShellCmd:
    """``shell [--mesh NAME] [--point DIM=N,...]``: an interactive shell on one host of the job."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("--mesh", type=str, default=None, metavar="NAME",
                               help="the mesh (default: the first)")
        subparser.add_argument("--point", type=str, default=None, metavar="DIM=N,DIM=N",
                               help="the host's coordinates (default: flat rank 0)")
        subparser.add_argument("-e", "--env", action="append", default=[], help="KEY=VALUE (repeatable)")
        subparser.add_argument("--workdir", type=str, default=None, help="working directory on the host")
        subparser.add_argument("--kill", action="store_true", default=False, help="kill the job after the shell exits")

    def run(self, args: argparse.Namespace) -> None:
        _run("shell", lambda: shell_on_job(mesh_name=args.mesh, point_str=args.point, env=args.env or None,
                                           workdir=args.workdir, kill=args.kill))


class ContextCmd:
    """``context create|use|rm NAME``, ``context ls``: named jobs side by side in one working directory."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        sub = subparser.add_subparsers(title="CONTEXT COMMANDS", dest="context_cmd")
        for name, fn, text, done in (("create", context_create, "Create a new context", "Created"),
                                     ("use", context_use, "Make NAME the active context", "Switched to"),
                                     ("rm", context_rm, "Remove a context (kills its job)", "Removed")):
            p = sub.add_parser(name, help=text)
            p.add_argument("name", type=str, help="Context name")
            p.set_defaults(context_func=lambda a, fn=fn, done=done: (
                fn(a.name), print(f"{done} context {a.name!r}")))
        p_ls = sub.add_parser("ls", help="List contexts")
        p_ls.set_defaults(context_func=lambda a: print(
            "\n".join(f"{'*' if active else ' '} {name}" for name, active in context_ls()) or "No contexts."))

    def run(self, args: argparse.Namespace) -> None:
        if not hasattr(args, "context_func"):
            args._subparser.print_help()
            sys.exit(1)
        _run("context", lambda: args.context_func(args) and None)


class KillCmd:
    """``kill [NAME]``: kill the job of context NAME (default: the active context)."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("name", nargs="?", default=None, help="context name (default: the active one)")

    def run(self, args: argparse.Namespace) -> None:
        def kill_it() -> int:
            name = args.name or current_context()
            if not kill(args.name):
                raise FileNotFoundError(f"no running job in context {name!r}")
            print(f"Killed context {name!r}")
            return 0

        _run("kill", kill_it)


class DashboardCmd:
    """``dashboard mast JOB``: Monarch's relay of a MAST job's dashboard (Meta-internal; refused here)."""

    def add_arguments(self, subparser: argparse.ArgumentParser) -> None:
        subparser.set_defaults(_dashboard_subparser=subparser)
        sub = subparser.add_subparsers(title="DASHBOARD COMMANDS", dest="dashboard_cmd")
        mast = sub.add_parser("mast", help="Relay an existing MAST job's Monarch dashboard through this host")
        mast.add_argument("job", type=str, help="Direct MAST job name.")
        mast.add_argument("--role-name", type=str, default=None, help="MAST task group that hosts the dashboard")
        mast.add_argument("--dashboard-port", type=int, default=_DEFAULT_DASHBOARD_PORT,
                          help="Dashboard port on the MAST task.")
        mast.set_defaults(dashboard_func=self._run_mast)

    def run(self, args: argparse.Namespace) -> None:
        if not hasattr(args, "dashboard_func"):
            args._dashboard_subparser.print_help()
            sys.exit(1)
        args.dashboard_func(args)

    def _run_mast(self, args: argparse.Namespace) -> None:
        sys.stderr.write("Error: `dashboard mast` relays Meta's MAST scheduler's dashboards, which only "
                         "Meta-internal builds of Monarch have; this project has no dashboard.\n")
        sys.exit(1)


def get_parser() -> argparse.ArgumentParser:
    """The parser of Monarch's ``monarch`` command; each sub-command sets ``func`` (its class's ``run``)."""
    parser = argparse.ArgumentParser(description="Monarch CLI: run code on remote workers (monarch-tensor)",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparser = parser.add_subparsers(title="COMMANDS")
    context_cmd = ContextCmd()
    context_parser = subparser.add_parser("context", help="Manage job contexts")
    context_cmd.add_arguments(context_parser)
    context_parser.set_defaults(func=context_cmd.run, _subparser=context_parser)
    for name, cmd, text in (
        ("apply", ApplyCmd(), "Provision workers from a job object (e.g. myjob.job)"),
        ("exec", ExecCmd(), "Run a command on workers. Sets MONARCH_RANK_<DIM> and MONARCH_SIZE_<DIM> env vars "
                            "for each rank dimension."),
        ("shell", ShellCmd(), "Open an interactive shell on one worker"),
        ("kill", KillCmd(), "Kill the active job"),
        ("debug", DebugCmd(), "Connect to the debugger of a script paused at breakpoint()"),
        ("dashboard", DashboardCmd(), "Serve Monarch dashboards (Meta-internal; refused here)"),
    ):
        cmd_parser = subparser.add_parser(name, help=text)
        cmd.add_arguments(cmd_parser)
        cmd_parser.set_defaults(func=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line), run the command, then shut the runtime down."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # (job specs are modules of the working directory)
    parser = get_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "func"):
        parser.print_help()
        sys.exit(1)
    try:
        args.func(args)
    finally:
        shutdown_context().get()


if __name__ == "__main__":
    main()
