"""The ``monarch-tensor`` command.

    monarch-tensor demo       # run the main demo on a local mesh
    monarch-tensor debug      # the monarch_dbg> prompt of a running script paused at breakpoint()
    monarch-tensor version
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
