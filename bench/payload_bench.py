"""Large actor payloads to a proc on another host: in the control link's frames, or pulled over the data plane.

A LocalJob agent stands for the other host: its proc is reached over tcp (CURVE-encrypted, through the
agent), exactly as on a cluster. One echo actor returns what it gets; each workload echoes a float32
tensor of SIZE MiB there and back, and GiB/s counts both directions (2 x size / time). Three ways:

  frames      MONARCH_TENSOR_PAYLOAD_THRESHOLD=0: the bytes ride the control link (the old path)
  data plane  the default: the receiver pulls them; cma here, since the "other host" is this machine
  tcp         the same, forced onto the tcp backend, as between two machines

The ways are interleaved per round; the table shows medians over ROUNDS x N_ECHO echoes.

    python bench/payload_bench.py [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from monarch_tensor.actor import Actor, endpoint  # noqa: E402
from monarch_tensor.job import LocalJob  # noqa: E402
from monarch_tensor.rdma import payload  # noqa: E402

SIZES_MIB = [1, 16, 64]
ROUNDS = 3
N_ECHO = 5
TINY = {"SIZES_MIB": [1], "ROUNDS": 1, "N_ECHO": 2}
WAYS = {"frames": ("frames (control link)", 0, ""), "dp": ("data plane (cma)", None, ""),
        "tcp": ("data plane (tcp)", None, "tcp")}


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def way(self, threshold: int, backend: str) -> None:
        _set_way(threshold, backend)

    @endpoint
    def pulls(self) -> dict:
        return _pulls()


def _pulls() -> dict:
    """Payloads pulled by this process, and data-plane reads per backend (to show which way ran)."""
    from monarch_tensor.rdma import transfer_stats

    return {"payloads": payload.stats()["pulled"], **{b: s["reads"] for b, s in transfer_stats().items()}}


def _set_way(threshold: int, backend: str) -> None:
    payload.THRESHOLD = threshold
    os.environ["MONARCH_TENSOR_RDMA_BACKEND"] = backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="one small size, few echoes (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="write settings and results as JSON")
    args = ap.parse_args()
    if args.tiny:
        globals().update(TINY)
    default = payload.THRESHOLD
    rates: dict[tuple[str, int], list[float]] = {}
    pulled = {w: {} for w in WAYS}  # reads made by the proc and by us, per way, summed over sizes
    job = LocalJob(meshes={"other": 1}, root_dir=tempfile.mkdtemp(prefix="payload-bench-"), ttl=600)
    try:
        procs = job.state().other.spawn_procs(per_host={"gpus": 1})
        e = procs.spawn("echo", Echo)
        for r in range(ROUNDS):
            for mib in SIZES_MIB:
                x = torch.randn(mib << 18)
                for way, (_, threshold, backend) in WAYS.items():
                    threshold = default if threshold is None else threshold
                    _set_way(threshold, backend)
                    e.way.call_one(threshold, backend).get(timeout=60)
                    before = [e.pulls.call_one().get(timeout=60), _pulls()]
                    y = e.echo.call_one(x).get(timeout=300)  # warm-up
                    assert torch.equal(x, y), "echoed tensor differs"
                    for _ in range(N_ECHO):
                        t = time.perf_counter()
                        e.echo.call_one(x).get(timeout=300)
                        rates.setdefault((way, mib), []).append(2 * x.nbytes / (time.perf_counter() - t) / 2**30)
                    after = [e.pulls.call_one().get(timeout=60), _pulls()]
                    for b, a in zip(before, after):
                        for k in a:
                            pulled[way][k] = pulled[way].get(k, 0) + a[k] - b.get(k, 0)
            print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr, flush=True)
        procs.stop().get(timeout=60)
    finally:
        job.kill()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nEcho of a float32 tensor to a proc behind a host agent (tcp control link), GiB/s both ways, "
          f"median of {ROUNDS} x {N_ECHO}; {os.cpu_count()} cores\n")
    head = "| way | " + " | ".join(f"{m} MiB" for m in SIZES_MIB) + " |"
    print(head)
    print("|" + " --- |" * (len(SIZES_MIB) + 1))
    for way, (name, _, _) in WAYS.items():
        print(f"| {name} | " + " | ".join(f"{med[(way, m)]:.2f}" for m in SIZES_MIB) + " |")
    print("| data plane / frames | " + " | ".join(f"{med[('dp', m)] / med[('frames', m)]:.1f}x" for m in SIZES_MIB)
          + " |")
    print("| tcp / frames | " + " | ".join(f"{med[('tcp', m)] / med[('frames', m)]:.1f}x" for m in SIZES_MIB) + " |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": {"tiny": args.tiny, "cores": os.cpu_count(), "python": platform.python_version(),
                               "torch": torch.__version__, "rounds": ROUNDS, "echoes": N_ECHO,
                               "load": os.getloadavg()},
                       "results": [{"way": w, "mib": m, "gib_s": med[(w, m)], "all": rates[(w, m)]}
                                   for (w, m) in sorted(med)],
                       "pulled": pulled}, f, indent=1)


if __name__ == "__main__":
    main()
