"""The ``monarch-tensor`` command.

    monarch-tensor demo       # run the main demo on a local mesh
    monarch-tensor debug      # the monarch_dbg> prompt of a running script paused at breakpoint()
    monarch-tensor version
    monarch-tensor keygen job.key             # a job key pair, written 0600
    monarch-tensor host --bind tcp://0.0.0.0:26600 --key-file job.key [--ttl 3600] [--address-file F]

The job workflow (Monarch 0.7's ``monarch apply/exec/shell/kill/context``), in a working directory:

    monarch-tensor apply myjob.job          # start the job made in myjob.py as `job` (or reattach to it)
    monarch-tensor exec python train.py     # run on rank 0 of its first mesh, output streamed here
    monarch-tensor exec --all hostname      # on every host; output to files on the hosts
    monarch-tensor exec --point hosts=1 --per-host gpus=2 -e K=V --workdir /w -- cmd args
    monarch-tensor exec --script run.sh     # a bash script (- reads it from stdin)
    monarch-tensor shell [--point hosts=1]  # an interactive shell on one host
    monarch-tensor kill [CONTEXT]
    monarch-tensor context create|use|rm NAME / context ls
"""

from __future__ import annotations

import argparse
import math
import runpy
import signal
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch-tensor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run examples/actors_basics.py on a local mesh")
    sub.add_parser("version", help="print the version")
    kg = sub.add_parser("keygen", help="write a new job key pair to a 0600 file")
    kg.add_argument("path")
    h = sub.add_parser("host", help="run a host agent (spawns and serves this machine's procs)")
    h.add_argument("--bind", required=True, help="tcp://HOST:PORT to listen on (PORT 0: any free port), or "
                                                  "tcp://DIAL_HOST:PORT@tcp://BIND_HOST:PORT: listen on BIND, "
                                                  "be reached at DIAL")
    h.add_argument("--key-file", default=None, help="the job's key file (else MONARCH_TENSOR_KEY_FILE or "
                                                    "MONARCH_TENSOR_CURVE_PUBLIC/SECRET)")
    h.add_argument("--ttl", type=_seconds(more_than_0=True), default=3600.0,
                   help="exit after this many seconds without a controller")
    h.add_argument("--address-file", default=None, help="write the address controllers should use here (0600)")
    dbg = sub.add_parser("debug", help="attach to the ranks of a running script paused at breakpoint()")
    dbg.add_argument("--pid", type=int, default=None, help="the script's process id (default: the newest)")
    dbg.add_argument("--wait", type=_seconds(), default=60.0, help="seconds to wait for a script to pause")
    _job_parsers(sub)
    args = p.parse_args(argv)
    if args.cmd in ("apply", "exec", "shell", "kill", "context"):
        code = _job_command(args)
        # Done: a Ctrl-C while this process exits (ending its sessions with the agents, which end a session
        # that goes quiet by themselves) ends it at once, without a traceback from wherever the exit was.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return code
    if args.cmd == "debug":
        from .debugger import _cli as _debug_cli

        return _debug_cli.main(args.pid, args.wait)
    if args.cmd == "version":
        from . import __version__

        print(__version__)
        return 0
    if args.cmd == "keygen":
        from .transport._curve import JobKeys

        try:
            JobKeys.generate().save(args.path)
        except OSError as e:
            print(f"monarch-tensor keygen: cannot write {args.path}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote a job key pair to {args.path} (mode 0600)")
        return 0
    if args.cmd == "host":
        from .errors import AddressInUseError, JobKeyError
        from .hosts.agent import run_worker_loop_forever

        try:
            run_worker_loop_forever(args.bind, key_file=args.key_file, ttl=args.ttl, address_file=args.address_file)
        except (AddressInUseError, JobKeyError, ValueError) as e:
            print(f"monarch-tensor host: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # (Ctrl-C where it runs in a terminal: it stopped its procs and exited)
            print("monarch-tensor host: interrupted; the agent stopped", file=sys.stderr)
            return 130
        return 0
    if args.cmd == "demo":
        demo = Path(__file__).resolve().parent.parent / "examples" / "actors_basics.py"
        if not demo.exists():
            print(f"monarch-tensor: the demo is not there ({demo}); run it from a source checkout", file=sys.stderr)
            return 2
        runpy.run_path(str(demo), run_name="__main__")
        return 0
    return 2


def _seconds(more_than_0: bool = False):
    """An argparse type: a finite number of seconds, >= 0 (> 0 with ``more_than_0``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < 0 or (more_than_0 and value == 0):
            raise argparse.ArgumentTypeError(f"a number of seconds {'> 0' if more_than_0 else '>= 0'}, got {text!r}")
        return value

    return parse


def _job_parsers(sub) -> None:
    ap = sub.add_parser("apply", help="start the job of a spec (module.attr), or reattach to it; it becomes the "
                                      "working directory's current job")
    ap.add_argument("module_path", nargs="?", default=None,
                    help="e.g. myjob.job (default: the current context's recorded spec)")
    ex = sub.add_parser("exec", help="run a command on the current job's hosts")
    target = ex.add_mutually_exclusive_group()
    target.add_argument("--all", action="store_true", dest="run_all",
                        help="every host of every mesh; output to files on the hosts")
    target.add_argument("--mesh", default=None, metavar="NAME", help="every host of mesh NAME; output to files")
    target.add_argument("--one", action="store_true", help="rank 0 of the first mesh, output here (the default)")
    target.add_argument("--point", default=None, metavar="DIM=N,...", help="one host of the first mesh, e.g. hosts=1")
    ex.add_argument("--per-host", default=None, metavar="DIM=N", dest="per_host",
                    help="N procs per host along DIM (each gets MONARCH_RANK_<DIM> and MONARCH_SIZE_<DIM>)")
    ex.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE", help="(repeatable)")
    ex.add_argument("--workdir", default=None, help="working directory on the hosts (default: this one, "
                                                    "where the host has it)")
    ex.add_argument("--output-dir", default=None, dest="output_dir", help="where --all/--mesh write output")
    ex.add_argument("--script", default=None, metavar="FILE", help="run a bash script (- : from stdin)")
    ex.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a Python module, as python -m")
    ex.add_argument("--kill", action="store_true", help="kill the job after the command")
    ex.add_argument("cmd_args", nargs=argparse.REMAINDER, metavar="cmd", help="the command and its arguments")
    sh = sub.add_parser("shell", help="an interactive shell on one host of the current job")
    sh.add_argument("--mesh", default=None, metavar="NAME")
    sh.add_argument("--point", default=None, metavar="DIM=N,...")
    sh.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE")
    sh.add_argument("--workdir", default=None)
    sh.add_argument("--kill", action="store_true", help="kill the job after the shell exits")
    kl = sub.add_parser("kill", help="kill the current job (or that of context NAME)")
    kl.add_argument("name", nargs="?", default=None)
    cx = sub.add_parser("context", help="named jobs side by side: create, use, rm NAME; ls")
    cx.add_argument("action", choices=["create", "use", "rm", "ls"])
    cx.add_argument("name", nargs="?", default=None)


def _job_command(args) -> int:
    """apply, exec, shell, kill, context: a bad spec or argument, a job that cannot start or a host that
    fails is one line on stderr and status 2; a command's own failure is its exit status."""
    from . import actor
    from .errors import ActorError, DeviceMeshError, JobKeyError, JobStartError, SyncError
    from .tools import commands as c

    # A proc of ours that dies fails what waits on it (exec's Future, the shell's loop), which reports it in
    # one line: the default hook would end this process first, with its own message.
    actor.unhandled_fault_hook = lambda failure: None
    try:
        if args.cmd == "apply":
            seconds = c.apply_job(args.module_path)
            print(f"Job {c.load_current_job().__class__.__name__} of {c.current_spec()} is ready ({seconds:.1f} s); "
                  f"context {c.current_context()!r}, job file {c.DEFAULT_JOB_PATH}")
            return 0
        if args.cmd == "exec":
            cmd = c.exec_argv(args.cmd_args, args.module)
            if not cmd and args.script is None:
                raise ValueError("no command: give one (exec python train.py), or --script FILE")
            return c.exec_on_job(cmd, run_all=args.run_all, mesh_name=args.mesh, point_str=args.point,
                                 env=args.env, workdir=args.workdir, kill=args.kill, script=args.script,
                                 per_host=c.parse_per_host(args.per_host), output_dir=args.output_dir)
        if args.cmd == "shell":
            return c.shell_on_job(mesh_name=args.mesh, point_str=args.point, env=args.env, workdir=args.workdir,
                                  kill=args.kill)
        if args.cmd == "kill":
            name = args.name or c.current_context()
            if not c.kill(args.name):
                raise FileNotFoundError(f"no running job in context {name!r} (no {c.context_state(name)})")
            print(f"Killed the job of context {name!r}")
            return 0
        if args.action == "ls":
            listed = c.context_ls()
            print("\n".join(f"{'*' if active else ' '} {name}" for name, active in listed) or "No contexts.")
            return 0
        if args.name is None:
            raise ValueError(f"context {args.action} needs a NAME")
        {"create": c.context_create, "use": c.context_use, "rm": c.context_rm}[args.action](args.name)
        print({"create": "Created", "use": "Switched to", "rm": "Removed"}[args.action] + f" context {args.name!r}")
        return 0
    except (FileNotFoundError, ValueError, TypeError, ImportError, AttributeError, IndexError, KeyError,
            JobStartError, JobKeyError, SyncError, ActorError, DeviceMeshError, TimeoutError) as e:
        # (one line: a remote error's text goes on with its traceback there)
        print(f"monarch-tensor {args.cmd}: {str(e).splitlines()[0] if str(e) else repr(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from .job.exec import interrupt_commands

        interrupt_commands()  # (their threads stop the procs, and the commands with them, before we exit)
        what = "interrupted"
        if args.cmd in ("exec", "shell"):
            what += "; stopping the command's procs"
        elif args.cmd == "apply":  # (a job that started and was not recorded was stopped: JobTrait.state)
            what += ("; the job runs ('monarch-tensor kill' stops it)" if c.context_state(c.current_context()).exists()
                     else "; no job was left running")
        print(f"monarch-tensor {args.cmd}: {what}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
