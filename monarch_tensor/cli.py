"""The ``monarch-tensor`` command.

    monarch-tensor demo       # run the main demo on a local mesh
    monarch-tensor debug      # the monarch_dbg> prompt of a running script paused at breakpoint()
    monarch-tensor version
    monarch-tensor keygen job.key             # a job key pair, written 0600
    monarch-tensor host --bind tcp://0.0.0.0:26600 --key-file job.key [--ttl 3600] [--address-file F]
"""

from __future__ import annotations

import argparse
import runpy
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
    h.add_argument("--bind", required=True, help="tcp://HOST:PORT to listen on (PORT 0: any free port)")
    h.add_argument("--key-file", default=None, help="the job's key file (else MONARCH_TENSOR_KEY_FILE or "
                                                    "MONARCH_TENSOR_CURVE_PUBLIC/SECRET)")
    h.add_argument("--ttl", type=float, default=3600.0, help="exit after this many seconds without a controller")
    h.add_argument("--address-file", default=None, help="write the address controllers should use here (0600)")
    dbg = sub.add_parser("debug", help="attach to the ranks of a running script paused at breakpoint()")
    dbg.add_argument("--pid", type=int, default=None, help="the script's process id (default: the newest)")
    dbg.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a script to pause")
    args = p.parse_args(argv)
    if args.cmd == "debug":
        from . import _debug_cli

        return _debug_cli.main(args.pid, args.wait)
    if args.cmd == "version":
        from . import __version__

        print(__version__)
        return 0
    if args.cmd == "keygen":
        from ._curve import JobKeys

        JobKeys.generate().save(args.path)
        print(f"wrote a job key pair to {args.path} (mode 0600)")
        return 0
    if args.cmd == "host":
        from .agent import run_worker_loop_forever
        from .errors import AddressInUseError, JobKeyError

        try:
            run_worker_loop_forever(args.bind, key_file=args.key_file, ttl=args.ttl, address_file=args.address_file)
        except (AddressInUseError, JobKeyError, ValueError) as e:
            print(f"monarch-tensor host: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "demo":
        demo = Path(__file__).resolve().parent.parent / "examples" / "actors_basics.py"
        if not demo.exists():
            print(f"monarch-tensor: the demo is not there ({demo}); run it from a source checkout", file=sys.stderr)
            return 2
        runpy.run_path(str(demo), run_name="__main__")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
