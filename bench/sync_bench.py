"""Workspace-sync benchmark: incremental sync latency and first-sync bandwidth, against the transport under it.

    python bench/sync_bench.py                                # full size (~1 min)
    python bench/sync_bench.py --json bench/out/sync_bench.json
    python bench/sync_bench.py --tiny --json /tmp/tiny.json   # smoke test (a few seconds)

Workloads, on N_PROCS procs of this machine (one host, so one writer proc per sync):
  changed_1      one .py file of a N_SMALL-file workspace (SMALL_BYTES on average, 50 per directory)
                 edited, then ``sync_workspace(ws, auto_reload=True)`` to every proc: ms per sync,
                 median of REPEATS (target: <= 200 ms for 5,000 files, 8 procs)
  first_small    the first full sync of that workspace (s)
  first_big      the first full sync of BIG_MB in BIG_FILES files into a fresh root (MB/s, median of
                 REPEATS; target: >= 80% of the data plane's bandwidth), three ways, interleaved: files
                 >= PULL_MIN pulled over the data plane (what writers on other hosts do; forced here
                 with PULL_SAME_HOST), every file in the messages (COPY_LOCAL off), and large files
                 copied by the writer from the sources it sees (the default on one host)
The big roots live on a RAM filesystem (/dev/shm where it exists, --root-dir to choose): on a VM's
disk the figure measures the disk's write-back, not the sync.
Each first full sync is also split into its phases (SyncResult.phases: asking the procs for their roots,
scanning and comparing, writing, reloading), printed as a second table.
References, measured in the same run:
  data plane     one proc reads the same files, mapped and registered by this process as RDMABuffers (as
                 a sync's client does), into warm page-aligned memory (as a writer's scratch is): what the
                 writer's pulls cost without writing files
  transport      the same bytes in the same message sizes (sync_messages CHUNK) sent to one proc as
                 out-of-band buffers of an actor call, until the last reply (same-host messages go
                 through /dev/shm)
  file writes    one proc writes the same files from memory into a fresh directory next to the roots:
                 the floor for any sync, whatever moves the bytes; again in two threads, as the writer's
                 two lanes write (on a 2-core machine, the most the cores can write)
  copies alone   one proc copies the same files from the sources into a fresh directory as a copying
                 writer does (its _copy_file: copy_file_range, two lanes) and does nothing else
  best any sync  BIG_MB written in two lanes plus one call() to every proc (a sync ends by telling each
                 proc to put the dirs on sys.path, once the files are there): no first sync can be faster;
                 and "best a copying sync": the copies alone plus that call
  memcpy         copying BIG_MB in memory once (warm)
Absolute figures drift between machines; compare the ratios, measured side by side.
"""

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from monarch_tensor.rdma import RDMABuffer  # noqa: E402

from monarch_tensor import Workspace  # noqa: E402
from monarch_tensor import workspace_sync as ws_sync  # noqa: E402
from monarch_tensor.actor import Actor, endpoint, this_host  # noqa: E402

# ---- settings ------------------------------------------------------------------------------
N_PROCS = 8          # procs synced to
N_SMALL = 5000       # files of the incremental workspace
SMALL_BYTES = 2000   # their average size
BIG_MB = 50          # the first-sync workspace
BIG_FILES = 100      # ... in this many files
REPEATS = 5          # timed repeats of each workload (median)
TIMEOUT = 120.0
TINY = dict(N_PROCS=2, N_SMALL=200, BIG_MB=2, BIG_FILES=4, REPEATS=2)
SETTINGS = ["N_PROCS", "N_SMALL", "SMALL_BYTES", "BIG_MB", "BIG_FILES", "REPEATS"]


class Sink(Actor):
    @endpoint
    def take(self, bufs) -> int:
        return sum(b.nbytes for b in bufs)

    @endpoint
    def pull(self, bufs) -> int:
        view = memoryview(mmap.mmap(-1, max(b.size() for b in bufs)))  # page-aligned, as a writer's scratch
        for b in bufs:
            b.read_into(view[:b.size()], timeout=TIMEOUT).get(timeout=TIMEOUT)
        return sum(b.size() for b in bufs)

    @endpoint
    def write_files(self, base: str, sizes: list[int], lanes: int = 1) -> float:
        """Seconds to write files of ``sizes`` from memory into a fresh ``base``, in ``lanes`` threads (files
        dealt out in turn, as the writer's two lanes take them)."""
        data = os.urandom(max(sizes))

        def one(i: int) -> None:
            fd = os.open(os.path.join(base, f"f{i}"), os.O_CREAT | os.O_WRONLY, 0o644)
            os.pwrite(fd, data[:sizes[i]], 0)
            os.close(fd)

        return _in_lanes(base, one, len(sizes), lanes)

    @endpoint
    def copy_files(self, src_dir: str, base: str, lanes: int = 2) -> float:
        """Seconds to copy the files of ``src_dir`` into a fresh ``base`` as a copying writer does (its
        ``_copy_file``, in ``lanes`` threads, files dealt out in turn), and nothing else: no temp names,
        modes, times or renames, no messages."""
        from monarch_tensor.workspace_sync._proc import _copy_file

        names = sorted(os.listdir(src_dir))

        def one(i: int) -> None:
            src = os.path.join(src_dir, names[i])
            fd = os.open(os.path.join(base, names[i]), os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                _copy_file(src, fd, os.path.getsize(src))
            finally:
                os.close(fd)

        return _in_lanes(base, one, len(names), lanes)

    @endpoint
    def ping(self) -> int:
        return 1


def _in_lanes(base: str, one, n: int, lanes: int) -> float:
    """Seconds to make the directory ``base`` and run ``one(i)`` for i < ``n`` in ``lanes`` threads (dealt out
    in turn; this thread is the first), then remove ``base`` (not timed)."""

    def lane(k: int) -> None:
        for i in range(k, n, lanes):
            one(i)

    t = time.perf_counter()
    os.makedirs(base)
    others = [threading.Thread(target=lane, args=(k,)) for k in range(1, lanes)]
    for th in others:
        th.start()
    lane(0)
    for th in others:
        th.join()
    dt = time.perf_counter() - t
    shutil.rmtree(base)
    return dt


def make_small(base: str) -> str:
    rng = np.random.default_rng(0)
    for i in range(N_SMALL):
        d = os.path.join(base, f"pkg{i // 50:03d}")
        os.makedirs(d, exist_ok=True)
        n = int(rng.integers(SMALL_BYTES // 4, SMALL_BYTES * 7 // 4))
        with open(os.path.join(d, f"mod{i % 50:02d}.py"), "w") as f:
            f.write(f"# file {i}\nVALUE = {i}\n" + "x = 1  # padding\n" * (n // 17))
    open(os.path.join(base, "__init__.py"), "w").close()
    return base


def make_big(base: str) -> str:
    os.makedirs(base, exist_ok=True)
    size = BIG_MB * (1 << 20) // BIG_FILES
    rng = np.random.default_rng(1)
    for i in range(BIG_FILES):
        with open(os.path.join(base, f"shard{i:03d}.bin"), "wb") as f:
            f.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return base


def bench(tmp: str, root_dir: str) -> dict:
    out: dict = {}
    procs = this_host().spawn_procs(per_host={"gpus": N_PROCS})
    try:
        small = Workspace(dirs=[make_small(os.path.join(tmp, "small"))])
        procs.env.set("WORKSPACE_DIR", os.path.join(tmp, "root-small")).get(timeout=TIMEOUT)
        t = time.perf_counter()
        first = procs.sync_workspace(small).get(timeout=TIMEOUT)
        out["first_small_s"] = time.perf_counter() - t
        assert first.files_sent == N_SMALL + 1, first.files_sent
        target = os.path.join(tmp, "small", "pkg000", "mod07.py")
        times = []
        for r in range(REPEATS):
            with open(target, "a") as f:
                f.write(f"EDIT_{r} = {r}\n")
            t = time.perf_counter()
            res = procs.sync_workspace(small, auto_reload=True).get(timeout=TIMEOUT)
            times.append(time.perf_counter() - t)
            assert res.changed == ["small/pkg000/mod07.py"], res.changed
        out["changed_1_ms"] = statistics.median(times) * 1e3
        out["changed_1_runs_ms"] = [x * 1e3 for x in times]

        big_dir = make_big(os.path.join(tmp, "big"))
        big = Workspace(dirs=[big_dir])
        nbytes = BIG_MB * (1 << 20) // BIG_FILES * BIG_FILES
        rates: dict[str, list[float]] = {"pulled": [], "messages": [], "copied": []}
        phases: dict[str, list[dict]] = {how: [] for how in rates}
        for r in range(REPEATS + 1):
            for how in rates:
                ws_sync.PULL_SAME_HOST = how == "pulled"  # one host here: make its writer pull as remote ones do
                ws_sync.COPY_LOCAL = how == "copied"
                root = os.path.join(root_dir, f"root-big-{how}-{r}")
                procs.env.set("WORKSPACE_DIR", root).get(timeout=TIMEOUT)
                t = time.perf_counter()
                res = procs.sync_workspace(big).get(timeout=TIMEOUT)
                dt = time.perf_counter() - t
                assert res.bytes_sent == nbytes, (res.bytes_sent, nbytes)
                assert res.bytes_pulled == (nbytes if how == "pulled" else 0), res.bytes_pulled
                assert res.bytes_copied == (nbytes if how == "copied" else 0), res.bytes_copied
                if r:  # the first one warms up the page cache of the sources
                    rates[how].append(nbytes / dt / 1e6)
                    phases[how].append(res.phases)
                shutil.rmtree(root, ignore_errors=True)
        ws_sync.PULL_SAME_HOST, ws_sync.COPY_LOCAL = False, True
        out["first_big_mb_s"] = statistics.median(rates["pulled"])
        out["first_big_messages_mb_s"] = statistics.median(rates["messages"])
        out["first_big_copied_mb_s"] = statistics.median(rates["copied"])
        out["first_big_phases_ms"] = {how: {k: statistics.median(p[k] for p in ps) * 1e3 for k in ps[0]}
                                      for how, ps in phases.items()}

        sink = procs.slice(gpus=0).spawn("sink", Sink)
        files = sorted(os.listdir(big_dir))
        rbufs, maps = [], []
        for name in files:  # mapped, as a sync's client maps the files it lets writers pull
            with open(os.path.join(big_dir, name), "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            rbufs.append(RDMABuffer(memoryview(maps[-1])))
        sink.pull.call_one(rbufs[:1]).get(timeout=TIMEOUT)
        rates_dp = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            got = sink.pull.call_one(rbufs).get(timeout=TIMEOUT)
            rates_dp.append(got / (time.perf_counter() - t) / 1e6)
        for b in rbufs:
            b.drop()
        del rbufs, maps  # (the mappings close once nothing holds a view of them)
        out["data_plane_mb_s"] = statistics.median(rates_dp)
        sizes = [os.path.getsize(os.path.join(big_dir, n)) for n in files]
        for lanes, key in ((1, "file_writes_mb_s"), (2, "file_writes_2_lanes_mb_s")):
            out[key] = statistics.median(
                nbytes / sink.write_files.call_one(os.path.join(root_dir, f"writes-{lanes}-{r}"), sizes,
                                                   lanes).get(timeout=TIMEOUT) / 1e6
                for r in range(REPEATS))
        out["copies_2_lanes_mb_s"] = statistics.median(
            nbytes / sink.copy_files.call_one(big_dir, os.path.join(root_dir, f"copies-{r}")).get(timeout=TIMEOUT)
            / 1e6 for r in range(REPEATS))
        # The least any first sync costs here: the files written in the writer's two lanes, and one call to
        # every proc (each must put the dirs on sys.path once they are written; ``reload``).
        everyone = procs.spawn("sink_all", Sink)
        everyone.ping.call().get(timeout=TIMEOUT)
        rtt = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            everyone.ping.call().get(timeout=TIMEOUT)
            rtt.append(time.perf_counter() - t)
        out["call_all_ms"] = statistics.median(rtt) * 1e3
        out["first_big_bound_mb_s"] = nbytes / (nbytes / (out["file_writes_2_lanes_mb_s"] * 1e6)
                                                + out["call_all_ms"] / 1e3) / 1e6
        out["first_big_copied_bound_mb_s"] = nbytes / (nbytes / (out["copies_2_lanes_mb_s"] * 1e6)
                                                       + out["call_all_ms"] / 1e3) / 1e6

        chunk = ws_sync.CHUNK
        bufs = [np.frombuffer(os.urandom(min(chunk, nbytes - o)), dtype=np.uint8) for o in range(0, nbytes, chunk)]
        sink.take.call_one([bufs[0]]).get(timeout=TIMEOUT)
        rates = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            futs = [sink.take.call_one([b]) for b in bufs]
            got = sum(f.get(timeout=TIMEOUT) for f in futs)
            rates.append(got / (time.perf_counter() - t) / 1e6)
        out["transport_mb_s"] = statistics.median(rates)
        src = bytearray(nbytes)
        dst = bytearray(nbytes)
        rates = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            dst[:] = src
            rates.append(nbytes / (time.perf_counter() - t) / 1e6)
        out["memcpy_mb_s"] = statistics.median(rates)
    finally:
        procs.stop()
    return out


def _table(header: tuple, rows: list) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--json", help="write settings and results here")
    ap.add_argument("--root-dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
                    help="where the big syncs' roots go (default: /dev/shm where writable, else a temp dir)")
    args = ap.parse_args()
    if args.tiny:
        globals().update(TINY)
    with tempfile.TemporaryDirectory(prefix="sync-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="sync-bench-roots-", dir=args.root_dir) as root_dir:
        r = bench(tmp, root_dir)
    rows = [
        (f"one changed file of {N_SMALL}, {N_PROCS} procs, auto_reload", f"{r['changed_1_ms']:.1f} ms",
         "target 200 ms", f"{200 / r['changed_1_ms']:.1f}x under target"),
        (f"first full sync, {N_SMALL} files", f"{r['first_small_s']:.2f} s", "", ""),
        (f"first full sync, {BIG_MB} MB in {BIG_FILES} files, pulled", f"{r['first_big_mb_s']:.0f} MB/s",
         f"data plane {r['data_plane_mb_s']:.0f} MB/s", f"{r['first_big_mb_s'] / r['data_plane_mb_s']:.0%} of it"),
        ("", "", f"file writes {r['file_writes_mb_s']:.0f} MB/s",
         f"{r['first_big_mb_s'] / r['file_writes_mb_s']:.0%} of it"),
        ("", "", f"memcpy {r['memcpy_mb_s']:.0f} MB/s", f"{r['first_big_mb_s'] / r['memcpy_mb_s']:.0%} of it"),
        ("... every file in the messages", f"{r['first_big_messages_mb_s']:.0f} MB/s",
         f"transport {r['transport_mb_s']:.0f} MB/s",
         f"{r['first_big_messages_mb_s'] / r['transport_mb_s']:.0%} of it"),
        ("... copied by the writer from the sources (default here)", f"{r['first_big_copied_mb_s']:.0f} MB/s",
         f"data plane {r['data_plane_mb_s']:.0f} MB/s",
         f"{r['first_big_copied_mb_s'] / r['data_plane_mb_s']:.0%} of it"),
        ("", "", f"file writes {r['file_writes_mb_s']:.0f} MB/s",
         f"{r['first_big_copied_mb_s'] / r['file_writes_mb_s']:.0%} of it"),
        ("", "", f"file writes, 2 lanes {r['file_writes_2_lanes_mb_s']:.0f} MB/s",
         f"{r['first_big_copied_mb_s'] / r['file_writes_2_lanes_mb_s']:.0%} of it"),
        ("", "", f"the same copies alone {r['copies_2_lanes_mb_s']:.0f} MB/s",
         f"{r['first_big_copied_mb_s'] / r['copies_2_lanes_mb_s']:.0%} of it"),
        ("best any first sync could do here", f"{r['first_big_bound_mb_s']:.0f} MB/s",
         f"data plane {r['data_plane_mb_s']:.0f} MB/s", f"{r['first_big_bound_mb_s'] / r['data_plane_mb_s']:.0%} of it"),
        ("best a copying sync could do here", f"{r['first_big_copied_bound_mb_s']:.0f} MB/s",
         f"data plane {r['data_plane_mb_s']:.0f} MB/s",
         f"{r['first_big_copied_bound_mb_s'] / r['data_plane_mb_s']:.0%} of it"),
    ]
    _table(("workload", "ours", "reference", "ratio"), rows)
    print(f"\nwhere a first full sync of {BIG_MB} MB went, ms (medians):")
    phase_names = list(next(iter(r["first_big_phases_ms"].values())))
    _table(("sync", *phase_names), [(how, *(f"{ms[k]:.1f}" for k in phase_names))
                                    for how, ms in r["first_big_phases_ms"].items()])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": {"tiny": args.tiny, "python": platform.python_version(), "cpus": os.cpu_count(),
                               "machine": platform.machine()},
                       "settings": {k: globals()[k] for k in SETTINGS}, "results": r}, f, indent=2)


if __name__ == "__main__":
    main()
