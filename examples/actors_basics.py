"""Actors on a local proc mesh: the tour of monarch_tensor's actor API.

    python examples/actors_basics.py

Spawns a mesh of 4 procs on this machine (the "gpus" dim is only a label: no
GPU is needed), puts an actor on each, and walks through every way to call
them: call, broadcast, slice + call_one, choose, stream. Then, on small meshes
of their own: the ping-pong between two actor meshes, and a proc that dies
(SupervisionError) while a slice without it keeps working; in between, an
endpoint that raises (ActorError). Runs in a few seconds.
"""

import asyncio
import os
import signal
import time

import monarch_tensor.actor
from monarch_tensor.actor import Actor, ActorError, SupervisionError, current_rank, current_size, endpoint, this_host

# -----------------------------------------------------------------------------
NUM_GPUS = 4          # procs in the main mesh (a label: no GPU needed)
NUM_PINGERS = 2       # actors on each side of the ping-pong
TIMEOUT = 30.0        # seconds any single wait may take
# -----------------------------------------------------------------------------


class Counter(Actor):
    """A bit of state on every rank."""

    def __init__(self, start: int):
        self.n = start
        self.rank = current_rank().rank

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    async def where(self) -> str:  # async endpoints work too
        return f"rank {self.rank} of {current_size()} (pid {os.getpid()})"

    @endpoint
    def slow_square(self, x: int) -> tuple:
        time.sleep(0.05 * (NUM_GPUS - self.rank))  # higher ranks answer first
        return self.rank, x * x

    @endpoint
    def divide(self, a: float, b: float) -> float:
        return a / b  # raises ZeroDivisionError for b == 0


class PingPong(Actor):
    """The seeds' ping-pong: each actor talks to its peer on another actor mesh."""

    def __init__(self, team: str):
        self.team = team
        self.rank = current_rank().rank

    @endpoint
    async def init(self, other):
        # `other` is a whole actor mesh passed as an argument; keep our peer only.
        self.peer = other.slice(**current_rank())

    @endpoint
    async def send(self, msg: str) -> str:
        return await self.peer.recv.call_one(f"{self.team}:{self.rank} says {msg!r}")

    @endpoint
    async def recv(self, msg: str) -> str:
        return f"{self.team}:{self.rank} got <{msg}>"


class Fragile(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit(self) -> None:
        os._exit(1)  # the whole proc dies, as in an abort or an OOM kill

    @endpoint
    def kill(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @endpoint
    async def sleep(self, s: float) -> float:
        await asyncio.sleep(s)  # async: the proc keeps handling other actors' messages
        return s


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 60 - len(title)), flush=True)


t0 = time.monotonic()

# -----------------------------------------------------------------------------
section("spawn")
procs = this_host().spawn_procs(per_host={"gpus": NUM_GPUS})
counters = procs.spawn("counter", Counter, 0)
print(f"proc mesh {procs.sizes}, actor mesh {counters}")
for point, where in counters.where.call().get(timeout=TIMEOUT):
    print(f"  gpus={point['gpus']}: {where}")

# -----------------------------------------------------------------------------
section("call, broadcast, slice + call_one, choose, stream")
print("call()            ->", counters.incr.call().get(timeout=TIMEOUT).values())
counters.incr.broadcast(10)  # fire and forget; ordered before later calls from here
print("after broadcast   ->", counters.value.call().get(timeout=TIMEOUT).values())
print("slice(gpus=2)     ->", counters.slice(gpus=2).incr.call_one(100).get(timeout=TIMEOUT))
first_two = counters.slice(gpus=slice(0, 2))
print("slice(gpus=0:2)   ->", first_two.value.call().get(timeout=TIMEOUT))
print("choose()          ->", counters.where.choose().get(timeout=TIMEOUT))
order = [fut.get(timeout=TIMEOUT) for fut in counters.slow_square.stream(7)]
print("stream() arrivals ->", ", ".join(f"rank {r}: {v}" for r, v in order))

# -----------------------------------------------------------------------------
section("ping-pong between two actor meshes")
ping_procs = this_host().spawn_procs(per_host={"gpus": NUM_PINGERS})
pong_procs = this_host().spawn_procs(per_host={"gpus": NUM_PINGERS})
ping = ping_procs.spawn("ping", PingPong, "ping")
pong = pong_procs.spawn("pong", PingPong, "pong")
ping.init.call(pong).get(timeout=TIMEOUT)
pong.init.call(ping).get(timeout=TIMEOUT)
for reply in ping.send.call("ping!").get(timeout=TIMEOUT).values():
    print(" ", reply)
for reply in pong.send.call("pong!").get(timeout=TIMEOUT).values():
    print(" ", reply)

# -----------------------------------------------------------------------------
section("an endpoint that raises -> ActorError")
try:
    counters.slice(gpus=3).divide.call_one(1.0, 0.0).get(timeout=TIMEOUT)
except ActorError as e:
    print(f"caught ActorError from {e.actor}.{e.method} on rank {e.rank}: {e.exc_repr}")
    print("  last line of the remote traceback:", e.traceback.strip().splitlines()[-1])
print("the actor keeps serving: divide(1, 4) ->",
      counters.slice(gpus=3).divide.call_one(1.0, 4.0).get(timeout=TIMEOUT))

# -----------------------------------------------------------------------------
section("a proc dies -> SupervisionError")
failures = []


def record_failure(failure):
    # Called when a proc dies and no caller was waiting on it. The default hook
    # stops the script; this one notes the failure and lets the script go on.
    failures.append(failure)


monarch_tensor.actor.unhandled_fault_hook = record_failure

small = this_host().spawn_procs(per_host={"gpus": 3})
fragile = small.spawn("fragile", Fragile)
sleeper = small.spawn("sleeper", Fragile)  # a second actor on the same procs
print(f"3 procs, pids {fragile.pid.call().get(timeout=TIMEOUT).values()}")

# 1. A caller is waiting on rank 1 when its proc dies: that call raises.
pending = sleeper.slice(gpus=1).sleep.call_one(30)
fragile.slice(gpus=1).exit.broadcast()
try:
    pending.get(timeout=TIMEOUT)
except SupervisionError as e:
    print(f"pending call raised SupervisionError (rank {e.rank}: {e.exit_status})")
    print(f"  {e}")

# 2. Rank 2 is SIGKILLed with nobody waiting: the fault hook gets it.
fragile.slice(gpus=2).kill.broadcast()
deadline = time.monotonic() + 5
while not failures and time.monotonic() < deadline:
    time.sleep(0.01)
for f in failures:
    print(f"fault hook recorded a failure (rank {f.rank}: {f.exit_status})")

# 3. Later calls on a mesh that includes a dead proc raise at once.
try:
    fragile.pid.call().get(timeout=TIMEOUT)
except SupervisionError as e:
    print(f"later call on the whole mesh raised SupervisionError (rank {e.rank}: {e.exit_status})")

# 4. A slice without the dead procs keeps working.
print("slice(gpus=0) without the dead procs still works -> pid",
      fragile.slice(gpus=0).pid.call_one().get(timeout=TIMEOUT))

# -----------------------------------------------------------------------------
section("stop")
for mesh in (procs, ping_procs, pong_procs, small):
    mesh.stop().get(timeout=TIMEOUT)
print(f"all meshes stopped; done in {time.monotonic() - t0:.1f} s")
