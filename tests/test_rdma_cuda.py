"""cuda_ipc (and CUDA staging for the other backends): only where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from monarch_tensor.rdma import BufferDroppedError, RDMABuffer

from monarch_tensor.actor import Actor, endpoint, this_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


class GpuOwner(Actor):
    @endpoint
    def make(self, n: int) -> RDMABuffer:
        self.t = torch.arange(n, device="cuda", dtype=torch.int64).to(torch.uint8)
        self.buf = RDMABuffer(self.t)
        return self.buf

    @endpoint
    def value(self) -> torch.Tensor:
        return self.t.cpu()

    @endpoint
    def drop(self) -> None:
        self.buf.drop()


@pytest.fixture(scope="module")
def owner():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    yield procs.spawn("gpu_owner", GpuOwner)
    procs.stop().get(timeout=30)


@pytest.mark.timeout(120)
def test_cuda_ipc_read_write_gpu_and_cpu_destinations(owner):
    buf = owner.make.call_one(1 << 20).get()
    assert buf.device.startswith("cuda") and buf.backend == "cuda_ipc"
    dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    buf.read_into(dst).get(timeout=60)
    ref = owner.value.call_one().get()
    assert torch.equal(dst.cpu(), ref)
    cpu_dst = torch.empty(4096, dtype=torch.uint8)
    buf.read_into(cpu_dst, offset=100).get(timeout=60)
    assert torch.equal(cpu_dst, ref[100:4196])
    buf.write_from(torch.zeros(10, dtype=torch.uint8, device="cuda"), offset=5).get(timeout=60)
    assert int(owner.value.call_one().get()[5:15].sum()) == 0
    owner.drop.call_one().get()
    with pytest.raises(BufferDroppedError):
        buf.read_into(dst).get(timeout=60)


@pytest.mark.timeout(120)
def test_cpu_backends_stage_cuda_destinations(owner, monkeypatch):
    monkeypatch.setenv("MONARCH_TENSOR_RDMA_BACKEND", "tcp")
    buf = owner.make.call_one(1 << 16).get()
    dst = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    buf.read_into(dst).get(timeout=60)
    assert torch.equal(dst.cpu(), owner.value.call_one().get())
