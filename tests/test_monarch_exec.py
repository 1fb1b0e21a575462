"""Monarch's execution model on one shared proc (issue 41): what runs while an endpoint or a constructor
blocks, how a proc stops."""

import asyncio

import pytest

from monarch_tensor.actor import Actor, ActorError, endpoint, this_host

T = 60


class Counter(Actor):
    def __init__(self, v: int) -> None:
        self.v = v

    @endpoint
    async def value(self) -> int:
        await asyncio.sleep(0.01)  # (a timer of the proc's loop)
        return self.v


class Relay(Actor):
    @endpoint
    async def value_via(self, counter) -> int:
        return await counter.value.call_one() + 1


class SyncActor(Actor):
    @endpoint
    def sync_endpoint(self, counter) -> int:
        return counter.value.choose().get(timeout=T)

    @endpoint
    def sync_via(self, relay, counter) -> int:
        return relay.value_via.call_one(counter).get(timeout=T)

    @endpoint
    def calls_itself(self, me) -> int:
        return me.sync_endpoint.call_one(None).get(timeout=T)


@pytest.fixture(scope="module")
def procs():
    m = this_host().spawn_procs(per_host={"gpus": 1})
    yield m
    m.stop().get(timeout=30)


def test_a_sync_endpoint_waits_on_an_async_endpoint_of_its_proc(procs):
    # Monarch's test_sync_actor and test_choose: a sync endpoint calling .get() on another actor's async
    # endpoint on the same proc gets its value; here also through a second async actor on that proc.
    counter = procs.spawn("counter", Counter, 5)
    relay = procs.spawn("relay", Relay)
    sync = procs.spawn("sync", SyncActor)
    assert sync.sync_endpoint.choose(counter).get(timeout=T) == 5
    assert sync.sync_via.call_one(relay, counter).get(timeout=T) == 6
    # The one wait that would deadlock, an actor waiting on its own reply, is a clear error at once.
    with pytest.raises(ActorError, match="calls itself"):
        sync.calls_itself.call_one(sync).get(timeout=T)
    assert sync.sync_endpoint.call_one(counter).get(timeout=T) == 5

