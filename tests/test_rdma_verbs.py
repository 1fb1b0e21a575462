"""The verbs backend at its seams (no machine here has an RDMA device), and the data plane's messages.

Not tested here because it cannot run here: posting work requests on a real
queue pair. What is tested: pyverbs imports (Debian's python3-pyverbs) and
reports "no device" cleanly, descriptor packing, chunk planning, the
registration cache, and the queue-pair handshake over the real control
plane with a recording stand-in for the device (the only fake, since no
device exists).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from monarch_tensor.rdma import messages, service
from monarch_tensor.rdma.backends import verbs

from monarch_tensor.transport import _wire
from monarch_tensor.transport.mailbox import current_mailbox
from monarch_tensor.transport.messages import PortRef


def test_pyverbs_imports_and_reports_no_device_cleanly():
    try:
        verbs.import_pyverbs()
    except ImportError as e:
        pytest.skip(f"pyverbs is not installed here (CI installs python3-pyverbs): {e}")
    assert verbs.enum("IBV_WR_RDMA_READ") != verbs.enum("IBV_WR_RDMA_WRITE")
    assert verbs.enum("IBV_QPT_RC") >= 0 and verbs.enum("IBV_ACCESS_REMOTE_READ") > 0
    reason = verbs.unavailable_reason()
    if reason is None:
        pytest.skip("this machine has an RDMA device: the 'no device' path cannot be checked")
    assert "no RDMA device" in reason
    assert verbs.available() is False


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1), st.binary(min_size=16, max_size=16),
       st.integers(1, 5))
def test_endpoint_packs_and_unpacks(qp_num, psn, lid, gid, mtu):
    e = verbs.Endpoint(qp_num, psn, lid, gid, mtu)
    assert verbs.Endpoint.unpack(e.pack()) == e


@given(st.text(min_size=1, max_size=40), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64 - 1))
def test_remote_memory_packs_and_unpacks(device, addr, rkey, length):
    m = verbs.RemoteMemory(device, addr, rkey, length)
    assert verbs.RemoteMemory.unpack(m.pack()) == m


@given(st.binary(min_size=16, max_size=16))
def test_gid_text_round_trips(raw):
    assert verbs.gid_bytes(verbs._gid_str(raw)) == raw


def test_malformed_descriptors_are_refused():
    with pytest.raises(ValueError):
        verbs.Endpoint.unpack(b"short")
    with pytest.raises(ValueError):
        verbs.RemoteMemory.unpack(b"\x05ab")
    with pytest.raises(ValueError):
        verbs.RemoteMemory.unpack(b"")


@settings(deadline=None)
@given(st.integers(0, 20_000), st.integers(1, 4096), st.integers(1, 20))
def test_chunk_plan_covers_the_range_exactly(length, max_chunk, max_outstanding):
    plan = verbs.plan_chunks(length, max_chunk, max_outstanding)
    pieces = [p for batch in plan for p in batch]
    assert all(0 < len(batch) <= max_outstanding for batch in plan)
    assert all(0 < n <= max_chunk for _, n in pieces)
    pos = 0
    for off, n in pieces:
        assert off == pos
        pos += n
    assert pos == length


def test_chunk_plan_refuses_nonsense():
    with pytest.raises(ValueError):
        verbs.plan_chunks(10, 0, 1)


class _FakeMR:
    def __init__(self, addr, length):
        self.addr, self.length, self.closed = addr, length, False
        self.lkey = self.rkey = addr & 0xFFFF

    def close(self):
        self.closed = True


def test_registration_cache_reuses_covering_entries_and_evicts():
    made = []

    def factory(addr, length, device):
        made.append((addr, length, device))
        return _FakeMR(addr, length)

    cache = verbs.MRCache(factory, capacity=1000)
    a = cache.get(100, 400)
    assert cache.get(150, 100) is a and cache.get(100, 400) is a  # covered: no new registration
    b = cache.get(100, 400, "cuda:0")  # same addresses on another device: a new one
    assert b is not a and len(made) == 2
    c = cache.get(5000, 500)  # 1300 bytes > 1000: the least recently used (a) goes
    assert a.closed and not b.closed and not c.closed
    cache.invalidate(5100, 10)
    assert c.closed and cache.bytes == 400


class _FakeDevice:
    """Stands in for an RDMA device (none exists here): hands out queue pairs and records connections."""

    def __init__(self, base):
        self.base, self.qps = base, []

    def new_qp(self):
        qp = type("QP", (), {})()
        qp.qp_num, qp.remote = self.base + len(self.qps), None
        self.qps.append(qp)
        return qp

    def endpoint(self, qp):
        return verbs.Endpoint(qp.qp_num, qp.qp_num & 0xFFFFFF, 7, bytes(range(16)), 5)

    def connect(self, qp, remote):
        qp.remote = remote


@pytest.mark.timeout(30)
def test_queue_pair_handshake_over_the_control_plane(monkeypatch):
    """Reader and owner (this process, over its own mailbox) swap endpoints; each QP connects to the other."""
    service.install()
    owner_dev, reader_dev = _FakeDevice(1000), _FakeDevice(2000)
    monkeypatch.setattr(verbs, "_connections", verbs.Connections(lambda: owner_dev, verbs.exchange_over_mailbox))
    monkeypatch.setattr(verbs, "available", lambda: True)
    reader = verbs.Connections(lambda: reader_dev, verbs.exchange_over_mailbox)
    me = current_mailbox().addr
    qp = reader.to_owner(me, "mlx5_0")
    assert reader.to_owner(me, "mlx5_0") is qp, "queue pairs are cached per peer"
    assert len(owner_dev.qps) == 1 and len(reader_dev.qps) == 1
    assert qp.remote.qp_num == owner_dev.qps[0].qp_num
    assert owner_dev.qps[0].remote.qp_num == qp.qp_num


@pytest.mark.timeout(30)
def test_handshake_with_an_owner_without_device_fails_clearly():
    service.install()
    me = current_mailbox().addr
    if verbs.available():
        pytest.skip("this machine has an RDMA device")
    with pytest.raises(Exception, match="no RDMA device|pyverbs"):
        verbs.exchange_over_mailbox(me, "mlx5_0", verbs.Endpoint(1, 1, 1, bytes(16), 5).pack(), timeout=10)


MESSAGES = [
    messages.ConnectQueuePair("ipc:///tmp/x", "mlx5_0", b"\0" * 27, PortRef("ipc:///tmp/y", 3)),
    messages.DropBuffer(12, 2**62),
    messages.ReleasePayload(13, 2**61),
]


def test_every_data_plane_message_is_listed_above():
    import dataclasses

    defined = {c for c in vars(messages).values() if dataclasses.is_dataclass(c) and c.__module__ == messages.__name__}
    assert defined == {type(m) for m in MESSAGES}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_and_have_handlers(msg):
    assert _wire.decode(_wire.encode(msg)) == msg
    assert type(msg) in service.HANDLERS


def test_publish_and_fetch_tensor_in_process():
    """The helper the tensor engine's to_mesh / fetch_shard call (same code path across procs)."""
    import torch
    from monarch_tensor.rdma import publish_tensor

    t = torch.randn(3, 5, dtype=torch.float64)
    h = publish_tensor(t.t())  # non-contiguous input is made contiguous
    import pickle

    h2 = pickle.loads(pickle.dumps(h))
    out = h2.fetch()
    assert torch.equal(out, t.t()) and out.shape == (5, 3)
    with pytest.raises(ValueError, match="shape"):
        h2.fetch(out=torch.empty(2, 2, dtype=torch.float64))
    h.drop()
    assert publish_tensor(torch.empty(0, 4)).fetch().shape == (0, 4)
