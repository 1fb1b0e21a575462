"""Every ``MONARCH_TENSOR_*`` environment variable, declared once: its type, default, where it acts, one line of
doc. Code reads a variable only through ``setting(name)`` (or ``take(name)`` for the runtime's hand-offs to a
proc), which validates it: a bad value is a ``ValueError`` naming the variable, the value and what it takes.

>>> from monarch_tensor.config import setting
>>> SPIN_S = setting("MONARCH_TENSOR_SPIN_US") * 1e-6

The variables behind ``configure()``'s options are declared here too (``option``: the option's name);
``monarch_tensor.config`` builds its options from them. docs/settings.md's tables are generated from this
registry (``rewrite_docs("docs/settings.md")`` rewrites them; tests/test_docs.py checks them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

PREFIX = "MONARCH_TENSOR_"
# How an on/off switch in the environment may be written (any case; empty: its default).
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
KINDS = ("int", "float", "seconds", "flag", "text", "choice")
ACTS = ("client", "procs", "agent", "runtime", "dev.sh")


@dataclass(frozen=True, slots=True)
class Setting:
    """One variable. ``kind``: int, float, seconds (a float), flag (on/off), text, or choice (one of
    ``choices``). ``acts``: where it is read: the script (client), every proc (procs), a host agent (agent),
    set by the runtime for its procs (runtime), or dev.sh. ``least``: the smallest number taken. ``takes``:
    what the error says a value must be (derived from the kind where empty)."""

    name: str
    kind: str
    default: Any
    acts: str
    section: str
    doc: str
    least: float = 0
    takes: str = ""
    choices: tuple[str, ...] = ()
    option: str = ""

    def accepts(self) -> str:
        if self.kind == "flag":
            return "1 or 0 (true or false)"
        if self.kind == "choice":
            return f"one of {list(self.choices)}"
        if self.takes:
            return self.takes
        return {"int": "a whole number", "float": "a number", "seconds": "a number of seconds",
                "text": "text"}[self.kind]

    def parse(self, raw: str | None) -> Any:
        """The value ``raw`` (the variable's text, None: unset) stands for, checked."""
        if self.kind == "text":
            return self.default if raw is None else raw
        if self.kind == "choice":
            if raw is None:
                return self.default
            if raw not in self.choices:
                raise ValueError(f"{self.name} must be {self.accepts()}, got {raw!r}")
            return raw
        if raw is None or not raw.strip():
            return self.default
        if self.kind == "flag":
            word = raw.strip().lower()
            if word in ON or word in OFF:
                return word in ON
            raise ValueError(f"{self.name} must be {self.accepts()}, got {raw!r}")
        try:
            value = int(raw) if self.kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.accepts()}, got {raw!r}") from None
        if not (value >= self.least and math.isfinite(value)):  # (nan compares false)
            raise ValueError(f"{self.name} must be {self.accepts()}, at least {self.least:g}, got {raw!r}")
        return value


_SPAWN, _MSG, _HOSTS, _ENGINE, _DATA, _SYNC, _DEBUG, _DEV, _RUNTIME, _OPTIONS = (
    "Procs and spawning", "Control plane (messages)", "Hosts, agents and jobs", "Tensor engine",
    "Data plane (`RDMABuffer`) and large payloads", "Workspace sync", "Debugger", "Set-up (`dev.sh`)",
    "Set by the runtime for its procs (not for users to set)", "Options of `configure()`")
_US = "a number of microseconds (0: block at once)"
_B = "a whole number of bytes"

_DECLARED = [
    # configure()'s options (config.SETTINGS is built from these).
    Setting("MONARCH_TENSOR_ENABLE_LOG_FORWARDING", "flag", True, "procs", _OPTIONS,
            "procs' stdout and stderr reach the script (procs spawned afterwards; procs.logging_option() switches "
            "a running mesh); on a job's hosts only when set explicitly, as Monarch's", option="enable_log_forwarding"),
    Setting("MONARCH_TENSOR_PREFIX_WITH_RANK", "flag", True, "client", _OPTIONS,
            "forwarded lines start with their proc's [rank]", option="prefix_with_rank"),
    Setting("MONARCH_TENSOR_FOLD_REPEATED_LINES", "flag", True, "client", _OPTIONS,
            "in a terminal or a notebook, the same line from several ranks within a quarter second prints once, "
            "with the ranks that printed it (logging_option(aggregate_window_sec=...) sets another window)",
            option="fold_repeated_lines"),
    Setting("MONARCH_TENSOR_RDMA_ALLOW_TCP_FALLBACK", "flag", True, "procs", _OPTIONS,
            "a buffer on another host that no RDMA device serves moves over TCP, with an RDMATcpFallbackWarning; "
            "False: that transfer fails", option="rdma_allow_tcp_fallback"),
    Setting("MONARCH_TENSOR_RDMA_DISABLE_IBVERBS", "flag", False, "procs", _OPTIONS,
            "never use the verbs backend, even where an RDMA device is found", option="rdma_disable_ibverbs"),
    Setting("MONARCH_TENSOR_RDMA_BACKEND", "choice", "", "procs", _OPTIONS,
            "the data-plane backend every transfer uses: verbs, cuda_ipc, cma or tcp (\"\": the best one for each "
            "pair of processes); read at every transfer", choices=("", "verbs", "cuda_ipc", "cma", "tcp"),
            option="rdma_backend"),
    Setting("MONARCH_TENSOR_SPAWN_TIMEOUT", "seconds", 60.0, "client", _OPTIONS,
            "seconds a proc's spawn may take before it fails (Monarch's mesh_proc_spawn_max_idle)", least=0.1,
            option="spawn_timeout"),
    Setting("MONARCH_TENSOR_JOB_START_TIMEOUT", "seconds", 0.0, "client", _OPTIONS,
            "seconds a job's host agents may take to come up; 0: the job's own default, LocalJob 60 s, SlurmJob "
            "120 s (Monarch's host_spawn_ready_timeout)", option="job_start_timeout"),
    Setting("MONARCH_TENSOR_STOP_TIMEOUT", "seconds", 5.0, "client", _OPTIONS,
            "seconds stopped procs get to exit before they are killed (Monarch's mesh_terminate_timeout, "
            "process_exit_timeout)", option="stop_timeout"),
    Setting("MONARCH_TENSOR_PAYLOAD_TIMEOUT", "seconds", 60.0, "procs", _OPTIONS,
            "seconds the receiver of a message may take to pull its large payload, its delivery (Monarch's "
            "message_delivery_timeout)", least=1.0, option="payload_timeout"),
    Setting("MONARCH_TENSOR_AGENT_HEARTBEAT_TIMEOUT", "seconds", 5.0, "client", _OPTIONS,
            "seconds of silence from a host agent after which its procs are taken for lost (Monarch's "
            "supervision_watchdog_timeout)", least=0.1, option="agent_heartbeat_timeout"),
    # Procs and spawning.
    Setting("MONARCH_TENSOR_MAX_PROCS_PER_HOST", "int", 1024, "client", _SPAWN,
            "the most procs one `spawn_procs` starts on each host (a guard against a typo forking until the "
            "machine gives out)", least=1),
    Setting("MONARCH_TENSOR_NO_WARMUP", "flag", False, "client", _SPAWN,
            "on: the controller does not build the tensor engine's fake-tensor mode while the first procs start "
            "and the template does not import `torch._dynamo` before forking (procs fork at once)"),
    Setting("MONARCH_TENSOR_BOOTSTRAP_TIMEOUT", "seconds", 600.0, "client", _SPAWN,
            "seconds `spawn_procs` waits for its `bootstrap=` function on every proc (a proc that dies fails it "
            "at once)", least=0.001),
    Setting("MONARCH_TENSOR_UNKNOWN_ACTOR_WAIT", "seconds", 2.0, "procs", _SPAWN,
            "seconds a call to an actor its proc does not have yet waits for the actor's spawn before it fails"),
    Setting("MONARCH_TENSOR_PRELOAD", "text", "torch", "client", _SPAWN,
            "comma-separated modules the template process imports before it forks procs (the runtime sets it "
            "empty for a script that has not imported torch)"),
    Setting("MONARCH_TENSOR_IDLE_PRELOAD", "text", "torch._dynamo", "client", _SPAWN,
            "comma-separated modules the template process imports in pieces while idle"),
    # Control plane.
    Setting("MONARCH_TENSOR_SPIN_US", "float", 200.0, "procs", _MSG,
            "microseconds a thread polls its socket before it blocks for the next message (0: block at once); "
            "the script and every proc", takes=_US),
    Setting("MONARCH_TENSOR_RECEIVE_ON_WAIT", "flag", True, "client", _MSG,
            "a client thread waiting on a reply receives it on the socket itself instead of from the I/O thread"),
    Setting("MONARCH_TENSOR_BATCH_GAP_US", "float", 200.0, "procs", _MSG,
            "calls and replies sent within this many microseconds of the last one are batched into one frame "
            "(0: no batching); the script and every proc", takes="a number of microseconds (0: no batching)"),
    Setting("MONARCH_TENSOR_SHM_THRESHOLD", "int", 1 << 20, "procs", _MSG,
            "bytes from which an array or tensor in a message to a process of this host travels through pooled "
            "shared memory", takes=_B),
    Setting("MONARCH_TENSOR_SHM_POOL_BYTES", "int", 1 << 30, "procs", _MSG,
            "shared-memory pool of a sending process, in bytes; beyond it a message gets a one-off file", takes=_B),
    Setting("MONARCH_TENSOR_SHM_MAP_CACHE_BYTES", "int", 2 << 30, "procs", _MSG,
            "bytes of shared-memory segments a receiver keeps mapped", takes=_B),
    # Hosts, agents and jobs.
    Setting("MONARCH_TENSOR_KEY_FILE", "text", None, "client", _HOSTS,
            "the job's key file (a CURVE key pair, `monarch-tensor keygen`) for host agents, `attach_to_workers` "
            "and TCP peers"),
    Setting("MONARCH_TENSOR_CURVE_PUBLIC", "text", None, "client", _HOSTS,
            "the job's public key as z85 text, with `MONARCH_TENSOR_CURVE_SECRET`, in place of a key file"),
    Setting("MONARCH_TENSOR_CURVE_SECRET", "text", None, "client", _HOSTS,
            "the job's secret key as z85 text (see above)"),
    Setting("MONARCH_TENSOR_CONNECT_TIMEOUT", "seconds", 30.0, "client", _HOSTS,
            "seconds connecting to a host agent may take", least=0.001),
    Setting("MONARCH_TENSOR_SESSION_TIMEOUT", "seconds", 10.0, "agent", _HOSTS,
            "seconds of silence from a controller after which a host agent kills that controller's procs",
            least=0.001),
    Setting("MONARCH_TENSOR_AGENT_TTL", "seconds", 3600.0, "agent", _HOSTS,
            "seconds a host agent with no controller waits before it exits (its default `ttl`)", least=0.001),
    Setting("MONARCH_TENSOR_FANOUT", "int", 8, "client", _HOSTS, "fan-out of a job's tree of host agents",
            least=1, takes="a whole number of children per agent"),
    Setting("MONARCH_TENSOR_GATHER", "flag", True, "client", _HOSTS,
            "a `call()` to procs behind agents has its replies gathered up the agent tree (off: each reply goes "
            "straight to the caller)"),
    Setting("MONARCH_TENSOR_GATHER_WINDOW_MS", "float", 20.0, "agent", _HOSTS,
            "how long an agent holds gathered replies before it sends what it has up",
            takes="a number of milliseconds"),
    # Tensor engine.
    Setting("MONARCH_TENSOR_FIRST_BATCH", "int", 16, "client", _ENGINE,
            "the instruction batch's size bound after a fetch or a pause (it doubles per batch up to "
            "`MONARCH_TENSOR_MAX_BATCH`)", least=1, takes="a whole number of instructions"),
    Setting("MONARCH_TENSOR_MAX_BATCH", "int", 512, "client", _ENGINE,
            "the largest batch of instructions sent to a mesh at once", least=1,
            takes="a whole number of instructions"),
    Setting("MONARCH_TENSOR_IDLE_FLUSH_S", "seconds", 0.001, "client", _ENGINE,
            "seconds after which a batch that stopped growing is sent"),
    Setting("MONARCH_TENSOR_KEEP_FREED_MB", "int", 1024, "procs", _ENGINE,
            "MiB of freed tensor memory a worker keeps at a heap's top for its next allocations (0: glibc's "
            "defaults)", takes="a whole number of MiB (0: glibc's defaults)"),
    Setting("MONARCH_TENSOR_COMPILE_STRETCHES", "choice", "", "procs", _ENGINE,
            "1: a compiled step's stretches of aten ops run through torch.compile (inductor; CUDA graphs on a GPU), "
            "compiled on a background thread while the step replays op by op; wait: compiled at the first replay, "
            "which waits; results then agree with uncompiled steps to rounding, not bit for bit (docs/compile.md)",
            choices=("", "0", "1", "wait")),
    Setting("MONARCH_TENSOR_STRETCH_MIN_OPS", "int", 32, "procs", _ENGINE,
            "the fewest aten ops a stretch needs to be handed to torch.compile (shorter ones run op by op)",
            least=1, takes="a whole number of ops"),
    Setting("MONARCH_TENSOR_COLLECTIVE_TIMEOUT", "seconds", 300.0, "procs", _ENGINE,
            "seconds a collective waits for its group", least=1,
            takes="a number of seconds a collective waits for its group"),
    Setting("MONARCH_TENSOR_NO_SHM_REDUCE", "flag", False, "procs", _ENGINE,
            "on: collectives whose procs all run on one host (reduces, and process groups' all-reduce, "
            "all-gather, reduce-scatter, all-to-all and broadcast) go through gloo (TCP on the loopback), not through "
            "shared memory"),
    # Data plane.
    Setting("MONARCH_TENSOR_PAYLOAD_THRESHOLD", "int", 1 << 20, "procs", _DATA,
            "bytes from which an array or tensor in a message to another host is pulled over the data plane (0: "
            "every payload in the message frames, on the CURVE links)",
            takes="a whole number of bytes (0: every payload in the message frames)"),
    Setting("MONARCH_TENSOR_PAYLOAD_TTL", "seconds", 300.0, "procs", _DATA,
            "seconds a published payload waits to be pulled before it is dropped", least=1,
            takes="a number of seconds a payload waits to be pulled"),
    Setting("MONARCH_TENSOR_PAYLOAD_MAX_BYTES", "int", 4 << 30, "procs", _DATA,
            "bytes published and not yet pulled, per process; beyond it a message carries its bytes in its "
            "frames", takes=_B),
    Setting("MONARCH_TENSOR_PAYLOAD_POOL_BYTES", "int", 1 << 30, "procs", _DATA,
            "bytes of released payload snapshots kept warm for reuse", takes=_B),
    Setting("MONARCH_TENSOR_RDMA_TCP_STREAMS", "int", 4, "procs", _DATA,
            "the most connections one `tcp` transfer uses (each carries at least 4 MiB, so a transfer under 8 MiB "
            "uses one)", least=1, takes="a whole number of connections"),
    Setting("MONARCH_TENSOR_RDMA_TCP_SPIN_US", "float", 200.0, "procs", _DATA,
            "microseconds a `tcp` reader or writer polls for the owner's answer before it blocks, and an owner "
            "for the next request (0: block at once)", takes=_US),
    Setting("MONARCH_TENSOR_RDMA_HOST", "text", None, "procs", _DATA,
            "the address a process's `tcp` data server announces and alone listens on (default: the host's "
            "default address announced, every address listened on)"),
    Setting("MONARCH_TENSOR_CMA_THREADS", "int", None, "procs", _DATA,
            "threads per large `cma` transfer (default: the cores this process may run on, at most 8)", least=1),
    Setting("MONARCH_TENSOR_RDMA_DEVICE", "text", None, "procs", _DATA,
            "the RDMA device `verbs` uses (`mlx5_0`...; default: the first)"),
    Setting("MONARCH_TENSOR_RDMA_GID_INDEX", "int", -1, "procs", _DATA,
            "the GID index `verbs` uses (-1: the first RoCE v2 or non-zero GID)", least=-1,
            takes="a GID index (-1: the first RoCE v2 one)"),
    Setting("MONARCH_TENSOR_RDMA_MR_CACHE_BYTES", "int", 16 << 30, "procs", _DATA,
            "bytes of registered memory regions `verbs` keeps cached", takes=_B),
    Setting("MONARCH_TENSOR_PYVERBS_DIR", "text", None, "procs", _DATA,
            "a directory holding `pyverbs`, tried before `/usr/lib/python3/dist-packages/pyverbs`"),
    # Workspace sync.
    Setting("MONARCH_TENSOR_SYNC_TIMEOUT", "seconds", 120.0, "procs", _SYNC,
            "seconds every wait of a workspace sync may take, on both sides", least=0.001),
    Setting("MONARCH_TENSOR_SYNC_PULL_MIN", "int", 256 << 10, "client", _SYNC,
            "bytes from which a file goes to a writer on another host over the data plane", takes=_B),
    Setting("MONARCH_TENSOR_SYNC_PULL_SAME_HOST", "flag", False, "client", _SYNC,
            "writers on this host pull files over the data plane instead of receiving them in the messages"),
    Setting("MONARCH_TENSOR_SYNC_COPY_LOCAL", "flag", True, "client", _SYNC,
            "a writer that sees the client's source dirs copies whole files of 64 KiB and more itself "
            "(`copy_file_range`)"),
    # Debugger.
    Setting("MONARCH_TENSOR_DEBUG_HOST", "text", "127.0.0.1", "client", _DEBUG,
            "the address the `monarch-tensor debug` server listens on"),
    Setting("MONARCH_TENSOR_DEBUG_PORT", "int", 0, "client", _DEBUG, "its port (0: any free one)",
            takes="a port number (0: any free one)"),
    Setting("MONARCH_TENSOR_DEBUG_LOCAL", "flag", True, "client", _DEBUG,
            "off: never open the `monarch_dbg>` prompt in the script's own terminal"),
    # dev.sh (read by the shell script only).
    Setting("MONARCH_TENSOR_VENV", "text", ".venv", "dev.sh", _DEV,
            "the virtual environment `dev.sh` installs into and runs from"),
    # Hand-offs from the runtime to the procs it starts.
    Setting("MONARCH_TENSOR_RANK", "text", None, "runtime", _RUNTIME, "the proc's rank in its mesh"),
    Setting("MONARCH_TENSOR_LOCAL_GPU", "text", None, "runtime", _RUNTIME,
            "the proc's `gpus` coordinate, from which a host agent sets `CUDA_VISIBLE_DEVICES`"),
    Setting("MONARCH_TENSOR_THREADS", "text", None, "runtime", _RUNTIME,
            "the proc's torch thread count: `N` (chosen) or `share:K` (its cores / K)"),
    Setting("MONARCH_TENSOR_PROC_BIND", "text", None, "runtime", _RUNTIME,
            "the proc's `proc_bind` entry (CPUs and NUMA nodes)"),
    Setting("MONARCH_TENSOR_ALIASES", "text", None, "runtime", _RUNTIME,
            "addresses a proc behind a host agent reaches through another (JSON)"),
    Setting("MONARCH_TENSOR_GATEWAY", "text", None, "runtime", _RUNTIME,
            "the controller's TCP gateway, for a proc behind a host agent"),
    Setting("MONARCH_TENSOR_PUBLIC_ADDR", "text", None, "runtime", _RUNTIME,
            "the routed address others reach a proc behind a host agent at"),
    Setting("MONARCH_TENSOR_LOG_PIPES", "text", None, "runtime", _RUNTIME,
            "the pipes a proc's stdout and stderr are relayed through"),
    Setting("MONARCH_TENSOR_STARTED_FD", "text", None, "runtime", _RUNTIME,
            "the pipe on which a proc says it started"),
    Setting("MONARCH_TENSOR_AGENT_UP", "text", None, "runtime", _RUNTIME,
            "the address of the agent a proc sends its messages for the controller up through"),
    Setting("MONARCH_TENSOR_HOST_PYTHON", "text", None, "runtime", _RUNTIME,
            "the interpreter `with_python_executable` started a proc with; its own `this_host()` spawns with it "
            "too"),
    Setting("MONARCH_TENSOR_BATCH_JOB", "text", None, "runtime", _RUNTIME,
            "in a script a job runs as its controller (`apply(client_script=...)`): the job file its "
            "`job.state()` reattaches from"),
]
REGISTRY: dict[str, Setting] = {s.name: s for s in _DECLARED}
SECTIONS = (_OPTIONS, _SPAWN, _MSG, _HOSTS, _ENGINE, _DATA, _SYNC, _DEBUG, _DEV, _RUNTIME)


def declared(name: str) -> Setting:
    """The declaration of variable ``name``; an undeclared one is a ``KeyError`` saying where to declare it."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared setting: declare it in monarch_tensor/_settings.py") from None


def setting(name: str) -> Any:
    """The value of environment variable ``name`` in this process (its default where it is unset), checked
    against its declaration."""
    return declared(name).parse(os.environ.get(name))


def take(name: str) -> str:
    """Remove hand-off variable ``name`` from this process's environment (so a proc's children do not inherit
    it) and return its text ("" where it is unset)."""
    declared(name)
    return os.environ.pop(name, "")


def env_number(name: str, default: float, what: str, *, integer: bool = False, least: float = 0) -> Any:
    """The number in environment variable ``name`` (``default`` where it is unset), checked as ``setting``
    checks a declared one; for variables that are not ``MONARCH_TENSOR_*`` settings (a test's, a benchmark's).

    >>> env_number("MY_REPEATS", 5, "a whole number of repeats", integer=True, least=1)
    """
    return Setting(name, "int" if integer else "float", default, "client", "", "", least=least,
                   takes=what).parse(os.environ.get(name))


def env_flag(name: str, default: bool) -> bool:
    """Whether the switch in environment variable ``name`` is on (``default`` where it is unset or empty):
    1/0, true/false, yes/no or on/off, in any case; anything else is an error naming the variable."""
    return Setting(name, "flag", default, "client", "", "").parse(os.environ.get(name))


def _shown(s: Setting) -> str:
    if s.acts == "runtime":
        return "-"
    if s.default is None:
        return "unset"
    if s.kind == "flag":
        return "on" if s.default else "off"
    if s.kind in ("text", "choice"):
        return f'`"{s.default}"`' if s.default == "" else f"`{s.default}`"
    if s.kind == "seconds":
        return f"{s.default:g} s"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


def _type(s: Setting) -> str:
    if s.kind == "choice":
        return "one of " + ", ".join(f'`{c}`' if c else '`""`' for c in s.choices)
    least = f" ≥ {s.least:g}" if s.kind in ("int", "float", "seconds") and s.least else ""
    return {"int": "integer", "float": "number", "seconds": "seconds", "flag": "switch", "text": "text"}[s.kind] + least


def docs_tables() -> str:
    """docs/settings.md's tables, one per section, as markdown."""
    out = []
    for section in SECTIONS:
        rows = [s for s in _DECLARED if s.section == section]
        if section == _OPTIONS:
            out += [f"### {section}", "", "| option | environment | type | default | acts in | what it does |",
                    "| --- | --- | --- | --- | --- | --- |"]
            out += [f"| `{s.option}` | `{s.name}` | {_type(s)} | {_shown(s)} | {s.acts} | {s.doc} |" for s in rows]
        else:
            out += [f"### {section}", "", "| variable | type | default | acts in | what it does |",
                    "| --- | --- | --- | --- | --- |"]
            out += [f"| `{s.name}` | {_type(s)} | {_shown(s)} | {s.acts} | {s.doc} |" for s in rows]
        out.append("")
    return "\n".join(out)


BEGIN, END = "<!-- settings: generated from monarch_tensor/_settings.py -->", "<!-- settings: end -->"


def rewrite_docs(path: str) -> bool:
    """Put ``docs_tables()`` between the markers of the markdown file ``path``; whether it changed."""
    text = open(path, encoding="utf-8").read()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{path} lacks the markers {BEGIN!r} ... {END!r}")
    new = f"{head}{BEGIN}\n\n{docs_tables()}\n{END}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text

