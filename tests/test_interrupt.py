"""Ctrl-C (a notebook's stop button) while the script waits on a call stops the call on its proc: a synchronous
endpoint gets KeyboardInterrupt raised in it, an async one is cancelled, one not started yet is dropped; the
proc answers its next calls at once, and the interrupted call's Future says what happened."""

import pytest
from test_logs import run_script

pytestmark = pytest.mark.timeout(120)

SCRIPT = '''
import asyncio, os, signal, threading, time
from monarch_tensor.actor import Actor, ActorError, endpoint, concurrent_endpoint, this_host

class Sleepy(Actor):
    def __init__(self):
        self.naps = 0

    @endpoint
    def nap(self, s):
        time.sleep(s)
        self.naps += 1
        return "woke"

    @endpoint
    async def anap(self, s):
        await asyncio.sleep(s)
        return "woke"

    @concurrent_endpoint
    async def cnap(self, s):
        await asyncio.sleep(s)
        return "woke"

    @endpoint
    def ping(self):
        return ("pong", self.naps)

class Other(Actor):
    @endpoint
    def ping(self):
        return "pong"

procs = this_host().spawn_procs({"gpus": 1})
a, b = procs.spawn("a", Sleepy), procs.spawn("b", Other)  # two actors of one proc
a.ping.call_one().get(timeout=60), b.ping.call_one().get(timeout=60)

def interrupt_soon():
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in the terminal, or Jupyter's stop button

def interrupted_wait(fut):
    threading.Thread(target=interrupt_soon).start()
    try:
        fut.get(timeout=100)
    except KeyboardInterrupt:
        return True
    return False

for kind in ("sync", "async", "concurrent"):
    fut = {"sync": a.nap, "async": a.anap, "concurrent": a.cnap}[kind].call_one(100)
    print(kind, "interrupted:", interrupted_wait(fut))
    # each of these would wait for the 100 s nap if it went on
    print(kind, "others answer:", b.ping.call_one().get(timeout=15), a.ping.call_one().get(timeout=15))
    try:
        fut.get(timeout=15)
    except ActorError as e:
        print(kind, "call:", "interrupted by its caller" in str(e))

# a call queued behind a running one is dropped before it starts
running = a.anap.call_one(100)
queued = a.nap.call_one(100)
print("queued interrupted:", interrupted_wait(queued))
try:
    queued.get(timeout=15)
except ActorError as e:
    print("queued call:", "before it started" in str(e))
print("running interrupted:", interrupted_wait(running))
print("after:", a.ping.call_one().get(timeout=15))  # the queued nap never ran: naps stays 0
procs.stop().get(timeout=30)
'''


def test_interrupting_a_wait_stops_the_call_on_its_proc(tmp_path):
    out = run_script(tmp_path, SCRIPT, timeout=100).stdout.splitlines()
    for kind in ("sync", "async", "concurrent"):
        assert f"{kind} interrupted: True" in out
        assert f"{kind} others answer: pong ('pong', 0)" in out
        assert f"{kind} call: True" in out
    assert "queued interrupted: True" in out and "queued call: True" in out
    assert "running interrupted: True" in out
    assert "after: ('pong', 0)" in out
