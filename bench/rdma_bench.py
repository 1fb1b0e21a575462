"""Data-plane benchmark: RDMABuffer read/write per backend between two procs of this host.

    python bench/rdma_bench.py                                   # ours (every backend here) + memcpy
    MT_BENCH_PEER_PATH=bench/out/peer-site python bench/rdma_bench.py --peers --json bench/out/rdma_bench.json
    python bench/rdma_bench.py --tiny --json /tmp/tiny.json      # smoke test (~10 s)
    python bench/rdma_bench.py --cuda --json bench/out/rdma_cuda.json   # GPU buffers (cuda_ipc), on a GPU machine
    python bench/rdma_bench.py --layers --json bench/out/rdma_layers.json   # where a tcp read's time goes
    python bench/rdma_bench.py --distance --json bench/out/rdma_distance.json   # cma and the page offsets

The owner of the buffer is an actor on a proc, its buffer a torch tensor of the largest size made there as a
user's would be (the table's header says how much of it sits on 2 MiB pages: procs allocate large tensors on
them, see monarch_tensor/hosts/host.py); the reader is this process. For every size, every
backend that can serve a CPU buffer here (forced with MONARCH_TENSOR_RDMA_BACKEND) reads and writes
into a warm destination, taking turns with memcpy, copy_ and the raw tcp stream below: ROUNDS rounds,
each of REPEATS runs of every measure (more for small sizes: until 50 ms have passed in all, up to 500);
the table shows the median as GiB/s, and as latency in µs. (The machine's speed drifts over seconds:
the raw stream's 4 KiB median swung between 20 and 33 µs from one round of 2,000 requests to the next,
so measures compared as ratios are taken side by side rather than a minute apart.)
Baselines in the same run, into warm destinations: memcpy (libc's, one thread, via ctypes.memmove),
torch's copy_ (parallel over every core: the limit on one host; cma splits large transfers over the
cores too, see rdma/backends/cma.py), one raw loopback TCP stream from a server process, a pyzmq copy (another process
sends the bytes over a zmq ipc socket; recv_into here), torch.distributed gloo send/recv between two
processes (timed on the receiver after a barrier), a control-plane round trip (call_one of a small
int), and with --peers PyTorch Monarch's RDMABuffer (torchmonarch, TCP fallback: no RDMA NIC here),
read by an actor on a second proc. Peers are never dependencies: install them aside as
bench/actor_bench.py's docstring shows. --plot PATH (default bench/out/rdma_bench.png) draws GiB/s
against size when matplotlib is installed (``pip install -e .[bench]``); --json keeps every number.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

# ---- settings ------------------------------------------------------------------------------
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
REPEATS = 5          # timed transfers per size and direction (after one warm-up) in each round
ROUNDS = 3           # rounds in which a size's measures in this process take turns (``in_turns``)
PEER_MAX = 64 << 20  # Monarch's TCP fallback is slow: sizes above this are skipped for it
TIMEOUT = 120.0
TINY = dict(SIZES=[4 << 10, 1 << 20], REPEATS=2, ROUNDS=2, PEER_MAX=1 << 20)
PEER_PATH = os.environ.get("MT_BENCH_PEER_PATH", "")
MARKER = "RDMA_BENCH_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _times(fn, repeats, min_total, max_repeats):
    """Seconds of ``repeats`` runs of ``fn()`` after one warm-up, and more (up to ``max_repeats``) until they
    add up to ``min_total`` seconds, so a small transfer's median is not five samples' noise."""
    fn()
    ts = []
    while len(ts) < repeats or (sum(ts) < min_total and len(ts) < max_repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def median_time(fn, repeats, min_total=0.05, max_repeats=500):
    """Median seconds of ``fn()`` (``_times``)."""
    return statistics.median(_times(fn, repeats, min_total, max_repeats))


def in_turns(measures: dict, repeats, min_total=0.05, max_repeats=500) -> dict:
    """Median seconds of each measure, sampled in turns: ``ROUNDS`` rounds, in each of which every measure
    runs as ``_times`` does (``repeats`` runs, and a ``ROUNDS``-th of the seconds and of the most runs).
    ``measures`` maps a name to ``(backend, fn)``: the backend is forced (ENV_BACKEND) while that
    measure's runs go on, None for none."""
    from monarch_tensor.rdma.buffer import ENV_BACKEND

    samples = {name: [] for name in measures}
    for _ in range(ROUNDS):
        for name, (backend, fn) in measures.items():
            if backend:
                os.environ[ENV_BACKEND] = backend
            try:
                samples[name] += _times(fn, repeats, min_total / ROUNDS, max_repeats // ROUNDS)
            finally:
                os.environ.pop(ENV_BACKEND, None)
    return {name: statistics.median(ts) for name, ts in samples.items()}


TCP_SERVER = r'''
import mmap, socket, sys
srv = socket.create_server(("127.0.0.1", 0))
# Real pages, as the buffers read (a bare bytearray(n) of zeros maps the kernel's zero page: every byte sent
# came from one cache-hot page), and page-aligned, as the owner's tensor is (see aligned()).
payload = memoryview(mmap.mmap(-1, int(sys.argv[1])))
payload[:] = b"\x01" * len(payload)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
with conn:
    while True:
        head = conn.recv(8)
        if len(head) < 8:
            break
        conn.sendall(payload[:int.from_bytes(head, "big")])
'''


@contextlib.contextmanager
def server_process(code: str, *args: str):
    """A baseline's server: ``python -c code args``, its stdout piped; left to exit on its own when the
    client is done (the servers here end with their connection), killed if the run failed first."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def aligned(n: int) -> memoryview:
    """``n`` writable bytes at a page boundary: the raw stream's destination. The kernel copies out of a
    socket at up to half the speed into memory 16 bytes past a 64-byte boundary, where a large bytearray's
    bytes start (on this project's VM, 1 MiB reads took 740 µs into a bytearray, 420-560 into a page-aligned
    buffer, taking turns; 4 MiB 2.7 against 0.9-1.3 ms): the raw stream gets the best case."""
    import mmap

    return memoryview(mmap.mmap(-1, n))


@contextlib.contextmanager
def raw_tcp_stream(max_size):
    """Floor for tcp: a plain socket server in another process (as the buffer's owner is) sends n bytes on
    one loopback connection for each 8-byte request. Yields ``read(buf)``, which asks for ``len(buf)``
    bytes and receives them into ``buf``. (A server thread of this process shares its GIL with the reader:
    its small-size figures swung between 16 and 80 µs run to run.) The first bytes are awaited as our tcp
    reader awaits them: polling up to its SPIN_S, then blocking."""
    import socket

    from monarch_tensor.rdma.backends.tcp import _recv_first, client_socket

    with server_process(TCP_SERVER, str(max_size)) as p:
        c = client_socket(socket.create_connection(("127.0.0.1", int(p.stdout.readline())), timeout=TIMEOUT))

        def read(buf):
            n = len(buf)
            c.sendall(n.to_bytes(8, "big"))
            got = _recv_first(c, [buf])  # polls before it blocks, as our tcp reader does
            while got < n:
                got += c.recv_into(buf[got:], n - got)

        try:
            yield read
        finally:
            c.close()  # the server exits


ZMQ_SERVER = r'''
import sys, zmq
s = zmq.Context().socket(zmq.REP)
s.bind(sys.argv[1])
payload = memoryview(bytearray(b"\x01" * int(sys.argv[2])))
print("ready", flush=True)
while True:
    n = int(s.recv())
    if n < 0:
        s.send(b"")
        break
    s.send(payload[:n], copy=False)
'''


def zmq_copy(sizes, repeats):
    """Baseline: another process sends n bytes over a zmq ipc socket, received into a warm buffer."""
    import tempfile

    import zmq

    addr = f"ipc://{tempfile.mkdtemp(prefix='rdma-bench-')}/zmq"
    with server_process(ZMQ_SERVER, addr, str(max(sizes))) as p:
        assert p.stdout.readline().strip() == "ready", "the zmq server did not start"
        s = zmq.Context.instance().socket(zmq.REQ)
        s.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
        s.connect(addr)
        out = {}
        for n in sizes:
            dst = bytearray(n)

            def once(n=n, dst=dst):
                s.send(b"%d" % n)
                assert s.recv_into(dst) == n

            out[n] = median_time(once, repeats)
        s.send(b"-1")  # the server exits
        s.recv()
        s.close(linger=0)
        return out


GLOO_RANK = r'''
import json, statistics, sys, time
import torch
import torch.distributed as dist
rank, port, sizes, repeats = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
out = {}
for n in sizes:
    t = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
    ts = []
    for i in range(repeats + 1):  # the first one warms up
        dist.barrier()
        start = time.perf_counter()
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        ts.append(time.perf_counter() - start)
    out[n] = statistics.median(ts[1:])
dist.destroy_process_group()
if rank == 1:
    print("RDMA_BENCH_RESULT " + json.dumps(out), flush=True)
'''


def gloo_send_recv(sizes, repeats):
    """Baseline: torch.distributed gloo send/recv between two processes of this host (time on the receiver)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(r), str(port), json.dumps(sizes), str(repeats)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in ranks]
    for line in outs[1][0].splitlines():
        if line.startswith(MARKER):
            return {int(k): v for k, v in json.loads(line[len(MARKER):]).items()}
    raise RuntimeError(f"gloo send/recv failed: {(outs[0][1] + outs[1][1]).strip()[-500:]}")


def one_size(n, buf, raw_read) -> dict:
    """Median seconds of every measure of this process at ``n`` bytes, taking turns (``in_turns``); ``buf``
    is the owner's buffer, ``raw_read`` the raw tcp stream's reader."""
    import torch
    from monarch_tensor.rdma.buffer import transfer_stats

    a, b = torch.empty(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
    dst, raw_dst = torch.empty(n, dtype=torch.uint8), aligned(n)
    before = transfer_stats()
    got = in_turns({
        "memcpy": (None, lambda: ctypes.memmove(a.data_ptr(), b.data_ptr(), n)),
        "copy_": (None, lambda: a.copy_(b)),
        "raw_tcp": (None, lambda: raw_read(raw_dst)),
        **{f"{name} read": (name, lambda: buf.read_into(dst, offset=0).get(timeout=TIMEOUT)) for name in ("cma", "tcp")},
        **{f"{name} write": (name, lambda: buf.write_from(dst).get(timeout=TIMEOUT)) for name in ("cma", "tcp")},
    }, REPEATS)
    after = transfer_stats()
    assert int(dst[-1]) == 1, "a read brought the wrong bytes"
    for name in ("cma", "tcp"):  # the forced backends moved the bytes
        assert after[name]["reads"] > before[name]["reads"] and after[name]["writes"] > before[name]["writes"], name
    return got


@functools.cache
def owner_class():
    """The actor that owns the benchmarks' CPU buffer: ``Owner(n)`` holds a tensor of ``n`` ones as an
    RDMABuffer (made here, on first use: torch and the project are imported late)."""
    import torch

    sys.path.insert(0, ROOT)
    from monarch_tensor.rdma import RDMABuffer

    from monarch_tensor.actor import Actor, endpoint

    class Owner(Actor):
        def __init__(self, n):
            self.t = torch.ones(n, dtype=torch.uint8)
            self.buf = RDMABuffer(self.t)

        @endpoint
        def buf_(self):
            return self.buf

        @endpoint
        def ping(self, x):
            return x

        @endpoint
        def huge_mib(self):
            """MiB of the mappings that hold the buffer that sit on 2 MiB pages, and the proc's THP switch."""
            lo, hi, kb, inside = self.t.data_ptr(), self.t.data_ptr() + self.t.numel(), 0, False
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(x, 16) for x in head.split("-"))
                        inside = a < hi and lo < b
                    elif inside and head == "AnonHugePages:":
                        kb += int(line.split()[1])
            return kb / 1024, os.environ.get("THP_MEM_ALLOC_ENABLE")

    return Owner


def run_ours():
    Owner = owner_class()
    from monarch_tensor.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    res = {"ctrl_rtt_us": None, "zmq": zmq_copy(SIZES, REPEATS), "gloo": gloo_send_recv(SIZES, REPEATS)}
    for name in ("memcpy", "copy_", "raw_tcp", "cma read", "cma write", "tcp read", "tcp write"):
        res[name] = {}
    try:
        owner = procs.spawn("owner", Owner, max(SIZES))
        buf = owner.buf_.call_one().get(timeout=TIMEOUT)
        res["owner_huge_mib"], res["owner_thp_env"] = owner.huge_mib.call_one().get(timeout=TIMEOUT)
        res["ctrl_rtt_us"] = 1e6 * median_time(lambda: owner.ping.call_one(1).get(timeout=TIMEOUT), 50)
        with raw_tcp_stream(max(SIZES)) as raw_read:
            for n in SIZES:
                for name, t in one_size(n, buf, raw_read).items():
                    res[name][n] = t
    finally:
        procs.stop().get(timeout=TIMEOUT)
    return res


LAYER_SIZES = [4 << 10, 64 << 10, 1 << 20]
LAYERS = ("raw tcp stream", "our reader, minimal owner", "our reader and owner", "read_into().get()")
MIN_OWNER = r'''
import mmap, socket, sys
sys.path.insert(0, sys.argv[2])
from monarch_tensor.rdma.backends.tcp import _ANSWER, _REQ, OK
srv = socket.create_server(("127.0.0.1", 0))
payload = memoryview(mmap.mmap(-1, int(sys.argv[1])))  # page-aligned, as the owner's tensor is
payload[:] = b"\x01" * len(payload)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
head, ok = bytearray(_REQ.size), _ANSWER[OK]
with conn:
    while conn.recv_into(head, len(head), socket.MSG_WAITALL) == len(head):
        offset, length = _REQ.unpack(head)[5:7]
        data = payload[offset:offset + length]
        sent = conn.sendmsg([ok, data])
        if sent < len(ok) + length:
            conn.sendall((ok + bytes(data))[sent:])
'''


def run_layers():
    """``--layers``: where a tcp read's time goes, at LAYER_SIZES, all taking turns (``in_turns``): the raw
    stream; our reader's socket exchange alone (``TcpBackend._one``, the backend's innermost call) against a
    minimal owner (MIN_OWNER: a plain socket server in another process that speaks our wire protocol, a
    header in and the answer and the bytes out, and does nothing else); the same exchange against the
    buffer's real owner (a proc: its data server looks the buffer up, checks the token and the range, polls
    for the next request); and ``read_into(...).get()``, the whole API on top. Medians of seconds."""
    Owner = owner_class()
    import torch
    from monarch_tensor.rdma._memory import as_mem
    from monarch_tensor.rdma.backends.tcp import READ
    from monarch_tensor.rdma.buffer import backend_named

    from monarch_tensor.actor import this_host

    n_max, tcp = max(LAYER_SIZES), backend_named("tcp")
    res = {name: {} for name in LAYERS}
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        buf = procs.spawn("owner", Owner, n_max).buf_.call_one().get(timeout=TIMEOUT)
        with server_process(MIN_OWNER, str(n_max), ROOT) as p, raw_tcp_stream(n_max) as raw_read:
            minimal = dataclasses.replace(buf._desc, tcp=("127.0.0.1", int(p.stdout.readline())))
            try:
                for n in LAYER_SIZES:
                    dst, raw_dst = torch.empty(n, dtype=torch.uint8), aligned(n)
                    mem = as_mem(dst)

                    def exchange(desc, n=n, mem=mem):
                        return lambda: tcp._one(READ, desc, 0, mem, 0, n, time.monotonic() + TIMEOUT, alone=True)

                    got = in_turns({
                        "raw tcp stream": (None, lambda raw_dst=raw_dst: raw_read(raw_dst)),
                        "our reader, minimal owner": (None, exchange(minimal)),
                        "our reader and owner": (None, exchange(buf._desc)),
                        "read_into().get()": ("tcp", lambda dst=dst: buf.read_into(dst, offset=0).get(timeout=TIMEOUT)),
                    }, REPEATS)
                    assert int(dst[0]) == 1 and int(dst[-1]) == 1, "a read brought the wrong bytes"
                    for name, t in got.items():
                        res[name][n] = t
            finally:
                for c in tcp._idle.pop(minimal.tcp, []):  # the minimal owner exits when its connection closes
                    c.close()
    finally:
        procs.stop().get(timeout=TIMEOUT)
    return res


def print_turns(title, res, cols, sizes, cell, json_path, settings, **extra):
    """Print ``res`` (column -> size -> seconds) under ``title`` as a table, a row per size, ``cell(column,
    size)`` in each; with ``json_path``, write ``settings`` (and REPEATS, ROUNDS), ``extra`` and the seconds."""
    print(title)
    print(f"{'size':>8} | " + " | ".join(f"{c:>26}" for c in cols))
    for n in sizes:
        print(f"{fmt_size(n):>8} | " + " | ".join(f"{cell(c, n):>26}" for c in cols))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"settings": {**settings, "REPEATS": REPEATS, "ROUNDS": ROUNDS}, **extra,
                       "seconds": {c: {str(n): t for n, t in res[c].items()} for c in cols}}, f, indent=1)


def print_layers(res, json_path):
    print_turns("where a tcp read's time goes (see run_layers), µs per read, medians, all taking turns; in "
                "brackets the raw stream's time as a share of it", res, LAYERS, LAYER_SIZES,
                lambda c, n: f"{res[c][n] * 1e6:9.1f} ({res['raw tcp stream'][n] / res[c][n]:5.0%})", json_path,
                {"LAYER_SIZES": LAYER_SIZES})


DISTANCE_SIZES = [64 << 10, 1 << 20, 4 << 20, 64 << 20]
DISTANCES = ("same page offset", "16 B apart, direct", "16 B apart, staged")


def run_distance():
    """``--distance``: cma reads and writes between the owner's tensor and local memory that starts at the
    same offset within a page as the remote bytes (as a tensor's does), or 16 bytes away from it (read:
    16 past; write: 16 before; as a numpy array's or a bytearray's bytes against a page-aligned tensor's),
    moved directly (the kernel's copy is then of the slow kind: rdma/backends/cma.py, ``short_distance``)
    or through staging memory, as cma does. All taking turns (``in_turns``); medians of seconds."""
    Owner = owner_class()
    import numpy as np
    from monarch_tensor.rdma.backends import cma

    from monarch_tensor.actor import this_host

    res = {f"{d} {c}": {} for d in ("read", "write") for c in DISTANCES}
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        n_max = max(DISTANCE_SIZES)
        buf = procs.spawn("owner", Owner, n_max).buf_.call_one().get(timeout=TIMEOUT)
        remote = buf._desc.addr % 4096
        backing = np.ones(n_max + 2 * 4096, dtype=np.uint8)
        stage_min = cma.STAGE_MIN

        def move(kind, apart, n, staged):
            start = (remote + apart - backing.ctypes.data) % 4096  # ``apart`` bytes past the remote bytes
            mem = backing[start:start + n]

            def f():
                cma.STAGE_MIN = stage_min if staged else 1 << 62
                try:
                    (buf.read_into(mem, offset=0) if kind == "read" else buf.write_from(mem)).get(timeout=TIMEOUT)
                finally:
                    cma.STAGE_MIN = stage_min

            return f

        for n in DISTANCE_SIZES:
            measures = {}
            for kind, apart in (("read", 16), ("write", -16)):
                measures[f"{kind} same page offset"] = ("cma", move(kind, 0, n, True))
                measures[f"{kind} 16 B apart, direct"] = ("cma", move(kind, apart, n, False))
                measures[f"{kind} 16 B apart, staged"] = ("cma", move(kind, apart, n, True))
            for name, t in in_turns(measures, REPEATS).items():
                res[name][n] = t
    finally:
        procs.stop().get(timeout=TIMEOUT)
    return res, cma._string_copies()


def print_distance(res, string_copies, json_path):
    print_turns("cma between the owner's tensor and local memory at the same offset within a page, or 16 bytes "
                "away (see run_distance), GiB/s (µs per transfer), medians, all taking turns; this CPU "
                f"{'has' if string_copies else 'lacks'} fast string copies (erms/fsrm: staging is on)", res,
                [f"{d} {c}" for d in ("read", "write") for c in DISTANCES], DISTANCE_SIZES,
                lambda c, n: f"{n / res[c][n] / 2**30:7.2f} ({res[c][n] * 1e6:7.0f})", json_path,
                {"DISTANCE_SIZES": DISTANCE_SIZES}, string_copies=string_copies)


def run_cuda():
    """GPU buffers (``--cuda``): an owner proc's CUDA tensor read and written by this process with cuda_ipc into
    GPU memory, read into CPU memory, and read over tcp (staged through the CPU), against a device-to-device
    ``copy_`` in this process (the limit on one GPU). Medians of seconds per size, as ``run_ours``."""
    import torch

    sys.path.insert(0, ROOT)
    from monarch_tensor.rdma import RDMABuffer

    from monarch_tensor.actor import Actor, endpoint, this_host

    if not torch.cuda.is_available():
        raise SystemExit("--cuda needs a CUDA GPU on this machine")

    class GpuOwner(Actor):
        def __init__(self, n):
            self.t = torch.ones(n, dtype=torch.uint8, device="cuda")
            self.buf = RDMABuffer(self.t)

        @endpoint
        def buf_(self):
            return self.buf

    names = ("d2d copy_", "cuda_ipc read", "cuda_ipc write", "cuda_ipc read to cpu", "tcp read (staged)")
    res = {name: {} for name in names}
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        buf = procs.spawn("gpu_owner", GpuOwner, max(SIZES)).buf_.call_one().get(timeout=TIMEOUT)
        for n in SIZES:
            for name, t in _cuda_size(n, buf).items():
                res[name][n] = t
    finally:
        procs.stop().get(timeout=TIMEOUT)
    return res, torch.cuda.get_device_name()


def _cuda_size(n, buf) -> dict:
    """``run_cuda``'s measures at ``n`` bytes, taking turns (``in_turns``)."""
    import torch
    from monarch_tensor.rdma.buffer import transfer_stats

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.ones(n, dtype=torch.uint8, device="cuda")
    dst, cpu_dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8)
    before = transfer_stats()
    got = in_turns({
        "d2d copy_": (None, synced(lambda: a.copy_(b))),
        "cuda_ipc read": ("cuda_ipc", lambda: buf.read_into(dst, offset=0).get(timeout=TIMEOUT)),
        "cuda_ipc write": ("cuda_ipc", lambda: buf.write_from(dst).get(timeout=TIMEOUT)),
        "cuda_ipc read to cpu": ("cuda_ipc", lambda: buf.read_into(cpu_dst, offset=0).get(timeout=TIMEOUT)),
        "tcp read (staged)": ("tcp", lambda: buf.read_into(dst, offset=0).get(timeout=TIMEOUT)),
    }, REPEATS)
    after = transfer_stats()
    assert int(dst[-1]) == 1 and int(cpu_dst[-1]) == 1, "a read brought the wrong bytes"
    for name in ("cuda_ipc", "tcp"):  # the forced backends moved the bytes
        assert after[name]["reads"] > before[name]["reads"], name
    return got


def print_cuda(res, gpu, json_path):
    print(f"RDMABuffer of GPU memory between two procs of this host ({gpu}), GiB/s (µs per transfer); medians as "
          "above, all measures taking turns")
    cols = list(res)
    print(f"{'size':>8} | " + " | ".join(f"{c:>20}" for c in cols))
    rows = []
    for n in SIZES:
        times = [res[c].get(n) for c in cols]
        cells = [f"{n / t / 2**30:8.2f} ({t * 1e6:8.0f})" if t else f"{'-':>20}" for t in times]
        print(f"{fmt_size(n):>8} | " + " | ".join(f"{c:>20}" for c in cells))
        rows.append({"size": n, **dict(zip(cols, times))})
    for n in SIZES:
        print(f"cuda_ipc read {fmt_size(n)}: {res['d2d copy_'][n] / res['cuda_ipc read'][n]:.0%} of a d2d copy_")
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"settings": {"SIZES": SIZES, "REPEATS": REPEATS, "ROUNDS": ROUNDS}, "gpu": gpu,
                       "seconds": rows}, f, indent=1)


MONARCH_WORKER = r'''
import json, statistics, sys, time, warnings
import torch
import monarch
monarch.configure(rdma_allow_tcp_fallback=True)
warnings.simplefilter("ignore")
from monarch.actor import Actor, endpoint, this_host
from monarch.rdma import RDMABuffer
SIZES, REPEATS = json.loads(sys.argv[1]), int(sys.argv[2])

class Owner(Actor):
    def __init__(self):
        self.t = torch.ones(max(SIZES), dtype=torch.uint8)
    @endpoint
    def buf(self, n):
        return RDMABuffer(self.t[:n])

class Reader(Actor):
    @endpoint
    async def bench(self, buf, n):
        dst = torch.empty(n, dtype=torch.uint8)
        await buf.read_into(dst)
        ts = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            await buf.read_into(dst)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

procs = this_host().spawn_procs(per_host={"gpus": 2})
owner = procs.slice(gpus=0).spawn("owner", Owner)
reader = procs.slice(gpus=1).spawn("reader", Reader)
out = {}
for n in SIZES:
    b = owner.buf.call_one(n).get()
    out[n] = reader.bench.call_one(b, n).get()
print("RDMA_BENCH_RESULT " + json.dumps(out), flush=True)
'''


def run_monarch():
    sizes = [n for n in SIZES if n <= PEER_MAX]
    env = dict(os.environ)
    if PEER_PATH:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(PEER_PATH), env.get("PYTHONPATH", "")])
    try:
        p = subprocess.run([sys.executable, "-c", MONARCH_WORKER, json.dumps(sizes), str(REPEATS)], env=env,
                           capture_output=True, text=True, timeout=600, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return None, "timed out"
    for line in p.stdout.splitlines():
        if line.startswith(MARKER):
            return {int(k): v for k, v in json.loads(line[len(MARKER):]).items()}, None
    err = p.stderr.strip().splitlines()
    return None, ("not installed" if "No module named 'monarch'" in p.stderr else (err[-1] if err else "error"))


def plot(path, rows, cols) -> str:
    """A PNG of GiB/s against size, one line per column; returns what happened, for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e .[bench])"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for c in cols:
        pts = [(r["size"], r["size"] / r[c] / 2**30) for r in rows if r.get(c)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=c)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GiB/s (median)")
    ax.set_title("RDMABuffer between two procs of one host")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"wrote {path}"


def fmt_size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main():
    global SIZES, REPEATS, ROUNDS, PEER_MAX
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", action="store_true", help="also run PyTorch Monarch's RDMABuffer (TCP fallback)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="write settings and results as JSON")
    ap.add_argument("--plot", metavar="PATH", default=os.path.join(ROOT, "bench", "out", "rdma_bench.png"),
                    help="write a PNG of GiB/s against size here (needs matplotlib; default: %(default)s)")
    ap.add_argument("--cuda", action="store_true", help="GPU buffers instead (cuda_ipc; needs a CUDA GPU)")
    ap.add_argument("--layers", action="store_true",
                    help="instead: where a tcp read's time goes, layer by layer, against the raw stream")
    ap.add_argument("--distance", action="store_true",
                    help="instead: cma into memory 16 bytes off the remote bytes' page offset, direct and staged")
    args = ap.parse_args()
    if args.tiny:
        SIZES, REPEATS, ROUNDS, PEER_MAX = TINY["SIZES"], TINY["REPEATS"], TINY["ROUNDS"], TINY["PEER_MAX"]
        LAYER_SIZES[:] = [4 << 10]
        DISTANCE_SIZES[:] = [64 << 10]
    if args.distance:
        print_distance(*run_distance(), args.json)
        return
    if args.layers:
        print_layers(run_layers(), args.json)
        return
    if args.cuda:
        print_cuda(*run_cuda(), args.json)
        return
    ours = run_ours()
    monarch, monarch_err = run_monarch() if args.peers else (None, "not run (--peers)")

    def gib(n, t):
        return n / t / 2**30 if t else float("nan")

    cols = ["memcpy", "copy_ (all cores)", "raw tcp stream", "pyzmq copy", "gloo send/recv", "cma read", "cma write", "tcp read", "tcp write", "Monarch read"]
    print(f"RDMABuffer between two procs of this host, GiB/s (µs per transfer); median of {ROUNDS} rounds of {REPEATS} "
          "or more (small sizes: until 50 ms in all); memcpy, copy_, the raw tcp stream, cma and tcp take turns")
    print(f"control-plane round trip (call_one, small int): {ours['ctrl_rtt_us']:.0f} µs")
    print(f"the owner's buffer: {fmt_size(max(SIZES))}, {ours['owner_huge_mib']:.0f} MiB of it on 2 MiB pages "
          f"(THP_MEM_ALLOC_ENABLE={ours['owner_thp_env']} in the owner's proc)")
    print(f"{'size':>8} | " + " | ".join(f"{c:>20}" for c in cols))
    rows = []
    for n in SIZES:
        times = [ours["memcpy"][n], ours["copy_"][n], ours["raw_tcp"][n], ours["zmq"][n], ours["gloo"][n], ours["cma read"][n], ours["cma write"][n], ours["tcp read"][n],
                 ours["tcp write"][n], (monarch or {}).get(n)]
        cells = [f"{gib(n, t):8.2f} ({t * 1e6:8.0f})" if t else f"{'-':>20}" for t in times]
        print(f"{fmt_size(n):>8} | " + " | ".join(f"{c:>20}" for c in cells))
        rows.append({"size": n, **{c: t for c, t in zip(cols, times)}})
    big = [n for n in SIZES if n >= 64 << 20]
    for n in big:
        for d in ("read", "write"):
            t = ours[f"cma {d}"][n]
            print(f"cma {d} {fmt_size(n)}: {ours['memcpy'][n] / t:.0%} of memcpy, "
                  f"{ours['copy_'][n] / t:.0%} of copy_ on all cores")
    for n in SIZES:
        print(f"tcp read {fmt_size(n)}: {ours['raw_tcp'][n] / ours['tcp read'][n]:.0%} of a raw tcp stream")
    for n in SIZES:
        if monarch and n in monarch:
            print(f"{fmt_size(n)} read: cma {monarch[n] / ours['cma read'][n]:.1f}x, "
                  f"tcp {monarch[n] / ours['tcp read'][n]:.1f}x Monarch's")
    if monarch_err:
        print(f"Monarch: {monarch_err}")
    sys.path.insert(0, ROOT)
    from monarch_tensor.rdma.buffer import backends

    print("backends here (this table measures cma and tcp; verbs and cuda_ipc run where available):")
    status = {}
    for b in backends():
        why = b.unavailable_reason()
        status[b.name] = "available" if why is None else f"unavailable: {why}"
        print(f"  {b.name:>8}: {status[b.name]}")
    print(plot(args.plot, rows, cols))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"settings": {"SIZES": SIZES, "REPEATS": REPEATS, "ROUNDS": ROUNDS, "PEER_MAX": PEER_MAX, "tiny": args.tiny},
                       "ctrl_rtt_us": ours["ctrl_rtt_us"], "owner_huge_mib": ours["owner_huge_mib"],
                       "owner_thp_env": ours["owner_thp_env"], "seconds": rows, "monarch_error": monarch_err,
                       "backends": status}, f,
                      indent=1)


if __name__ == "__main__":
    main()
