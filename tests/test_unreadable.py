"""A message that pickles where it is sent but cannot be unpickled where it arrives fails its waiters.

Before, its receiver logged "dropped a malformed message" and whoever waited on it (the caller of an
endpoint, the fetch of a tensor) waited until its own timeout. Now the receiver reads the message as far
as it can (``_wire._salvage``: what could not be rebuilt becomes a stub) and answers with the error.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from monarch_tensor import RemoteException, fetch_shard, remote, this_host
from monarch_tensor.actor import Actor, ActorError, endpoint
from monarch_tensor.errors import ProtocolError
from monarch_tensor.transport import _wire
from monarch_tensor.transport.messages import CallEndpoint, PortRef, SendToPort

pytestmark = pytest.mark.timeout(120)

# Set in this (the client's) process once the procs run, so the procs never see it.
IN_CLIENT = "MT_TEST_UNREADABLE_IN_CLIENT"


def _rebuild_outside_client(tag: str):
    if os.environ.get(IN_CLIENT) == "1":
        raise ValueError(f"{tag}: refuses to be rebuilt in the client")
    return ("rebuilt", tag)


def _rebuild_in_client(tag: str):
    if os.environ.get(IN_CLIENT) != "1":
        raise ValueError(f"{tag}: refuses to be rebuilt on a proc")
    return ("rebuilt", tag)


class OnlyInClient:
    """Unpickles in the client only: sent to a proc, it cannot be read there."""

    def __reduce__(self):
        return (_rebuild_in_client, ("OnlyInClient",))


class NeverInClient:
    """Unpickles on procs only: returned to the client, it cannot be read there."""

    def __reduce__(self):
        return (_rebuild_outside_client, ("NeverInClient",))


def _raise(*args):
    raise ValueError("this reducer always raises")


class RaisesOnLoad:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self):
        return (_raise, (self.tag,))


class BadState:
    def __init__(self) -> None:
        self.x = 1

    def __setstate__(self, state) -> None:
        raise RuntimeError("refuses its state")


class Slotted:
    __slots__ = ("inner",)

    def __init__(self, inner) -> None:
        self.inner = inner


# ---- the salvage itself ---------------------------------------------------------------------

def _decode_unreadable(msg) -> _wire.Unreadable:
    with pytest.raises(_wire.Unreadable) as info:
        _wire.decode(_wire.encode(msg))
    assert not isinstance(info.value, _wire.PayloadLost)
    return info.value


def test_an_unreadable_argument_leaves_the_calls_reply_port_and_its_other_arguments():
    t = torch.arange(6.0)
    msg = CallEndpoint("trainer", "step", (t, RaisesOnLoad("a"), {"lr": 0.1}), {"k": [1, 2]},
                       PortRef("ipc:///tmp/x", 42))
    e = _decode_unreadable(msg)
    got = e.message
    assert isinstance(got, CallEndpoint)
    assert (got.actor, got.method, got.reply, got.kwargs) == ("trainer", "step", PortRef("ipc:///tmp/x", 42),
                                                                {"k": [1, 2]})
    assert torch.equal(got.args[0], t) and got.args[2] == {"lr": 0.1}
    assert isinstance(got.args[1], _wire._Stub)
    assert isinstance(e.error, ProtocolError)
    assert "trainer.step" in str(e.error) and "this reducer always raises" in str(e.error)


def test_an_unreadable_reply_keeps_its_port():
    e = _decode_unreadable(SendToPort(7, [RaisesOnLoad("r")], None, 3))
    assert isinstance(e.message, SendToPort) and (e.message.port_id, e.message.rank) == (7, 3)
    assert "a reply" in str(e.error)


def test_a_class_the_receiver_cannot_import_and_a_setstate_that_raises_become_stubs():
    mod = types.ModuleType("mt_test_vanishing")

    class Gone:
        pass

    Gone.__module__, Gone.__qualname__ = "mt_test_vanishing", "Gone"
    mod.Gone = Gone
    sys.modules["mt_test_vanishing"] = mod
    try:
        frames = _wire.encode(CallEndpoint("a", "m", (Gone(), BadState(), 5), {}, PortRef("x", 1)))
    finally:
        del sys.modules["mt_test_vanishing"]  # the receiver cannot import it
    with pytest.raises(_wire.Unreadable) as info:
        _wire.decode(frames)
    args = info.value.message.args
    assert isinstance(args[0], _wire._Stub) and isinstance(args[1], _wire._Stub) and args[2] == 5


def test_a_body_that_is_not_a_pickle_is_malformed_not_unreadable():
    frames = _wire.encode(("anything",))
    first = bytearray(frames[0])
    first[8:] = b"\x80\x05garbage that is no pickle"
    with pytest.raises(ProtocolError) as info:
        _wire.decode([bytes(first)])
    assert not isinstance(info.value, _wire.Unreadable)


def test_holds_finds_stubs_wherever_they_are():
    stub = _wire._Stub()

    def closure():
        return stub

    assert not _wire.holds(([1, "a"], {"k": (2.0, None)}, Slotted(3), closure.__code__))
    assert _wire.holds([{"k": (1, stub)}])
    assert _wire.holds({stub: 1})
    assert _wire.holds(Slotted(Slotted([stub])))
    assert _wire.holds(types.SimpleNamespace(a=[stub]))
    assert _wire.holds(closure)
    assert _wire.holds([torch.ones(1)], kinds=(torch.Tensor,))
    assert _wire.holds(list(range(10)), budget=5)  # too large to look through: assumed to hold one
    loop: list = []
    loop.append(loop)
    assert not _wire.holds(loop)


# ---- through the runtime ----------------------------------------------------------------------

class Echo(Actor):
    @endpoint
    def take(self, x) -> str:
        return f"took {x!r}"

    @endpoint
    def give(self) -> NeverInClient:
        return NeverInClient()

    @endpoint
    def ping(self) -> int:
        return 1


def _add_one(x, extra):
    return x + 1


@pytest.fixture(scope="module")
def procs():
    os.environ.pop(IN_CLIENT, None)
    mesh = this_host().spawn_procs(per_host={"gpus": 2})
    os.environ[IN_CLIENT] = "1"
    yield mesh
    os.environ.pop(IN_CLIENT, None)
    mesh.stop().get(timeout=30)


def test_a_call_whose_arguments_cannot_be_unpickled_on_the_proc_fails_its_caller(procs):
    echo = procs.spawn("echo_args", Echo)
    with pytest.raises(ProtocolError, match=r"cannot unpickle the arguments of echo_args.take .*"
                                            r"OnlyInClient: refuses to be rebuilt on a proc"):
        echo.take.call(OnlyInClient()).get(timeout=60)
    assert echo.ping.call().get(timeout=60).values() == [1, 1]  # the procs go on serving


class Holds(Actor):
    def __init__(self, x) -> None:
        self.x = x

    @endpoint
    def ping(self) -> int:
        return 1


def test_calls_to_an_actor_whose_spawn_cannot_be_unpickled_fail_with_that_error(procs):
    # They waited 2 s for a spawn that never came, then said no actor of that name was spawned.
    holds = procs.spawn("holds_unreadable", Holds, RaisesOnLoad("in a spawn"))
    with pytest.raises(ActorError, match="cannot unpickle a SpawnActor .*this reducer always raises"):
        holds.ping.call().get(timeout=60)
    with pytest.raises(ProtocolError, match="cannot unpickle a SpawnActor"):
        holds.initialized.get(timeout=60)


def test_a_reply_that_cannot_be_unpickled_in_the_client_fails_its_caller(procs):
    echo = procs.spawn("echo_reply", Echo)
    with pytest.raises(ProtocolError, match="cannot unpickle a reply .*NeverInClient: refuses"):
        echo.give.call().get(timeout=60)
    with pytest.raises(ProtocolError, match="cannot unpickle a reply"):
        echo.slice(gpus=1).give.call_one().get(timeout=60)
    assert echo.ping.call().get(timeout=60).values() == [1, 1]


def test_a_tensor_instruction_that_cannot_be_unpickled_fails_its_results_and_the_rest_runs(procs):
    add_one = remote(_add_one, propagate=lambda x, extra: x)
    with procs.activate():
        x = torch.ones(3)  # in the same batch as the unreadable call below
        y = add_one(x, OnlyInClient())
        z = y * 2  # a dependent: fails with the same error without running
        w = x + 5
        with pytest.raises(RemoteException, match="cannot unpickle it on this proc: .*OnlyInClient: refuses"):
            fetch_shard(z).result(timeout=60)
        assert fetch_shard(w, gpus=1).result(timeout=60).tolist() == [6.0, 6.0, 6.0]
        assert fetch_shard(add_one(x, 0)).result(timeout=60).tolist() == [2.0, 2.0, 2.0]


def test_a_tools_protocol_record_is_an_envelope_with_its_reply_port():
    """The records of the protocol modules above the transport (workspace sync's here; registered from
    monarch_tensor/__init__.py, ``_wire.add_envelope_modules``) are read as envelopes too: a relay that cannot
    deliver one tells its sender at its reply port."""
    from monarch_tensor.workspace_sync.messages import WriteFiles

    msg = WriteFiles("s1", "key", ("/src",), (("w", 1, 0, RaisesOnLoad("w"), False),), 5, True,
                     PortRef("ipc:///tmp/y", 9))
    [got] = _wire.envelopes(_wire.encode(msg))
    assert isinstance(got, WriteFiles) and got.reply == PortRef("ipc:///tmp/y", 9)
    assert (got.sync_id, got.dirs) == ("s1", ("/src",))
    with pytest.raises(ValueError, match="module names"):
        _wire.add_envelope_modules("")
