"""CUDA IPC's lifecycle (shared/wire/cuda_ipc.py) without a GPU: a host-memory backend of torch's shape.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_cuda_ipc.py.
"""

from __future__ import annotations

import torch

from specserve.shared.wire import cuda_ipc
from specserve.shared.wire.messages import Speculate, SpeculateReply
from specserve.shared.wire.rpc import RpcClient, RpcServer
from tests.support.host_ipc import HostIpc, run


def test_rpc_links_exchange_tensors_as_handles_and_leave_none_unopened(monkeypatch, tmp_path):
    """A real server and client on a Unix socket with cuda_ipc on: each call's tensor and its reply go as
    handles, every handle is opened exactly once, and each end keeps only its last frame's tensors."""
    fake = HostIpc()
    monkeypatch.setattr(cuda_ipc, "default_backend", lambda: fake)
    seen: list[torch.Tensor] = []

    async def handler(body, tensors):
        seen.append(tensors["x"])
        return SpeculateReply([], 0.0, 0.0, 0.0, 0, 0), {"y": tensors["x"] * 2, "n": torch.tensor([len(seen)])}

    async def main():
        server = RpcServer(handler, cuda_ipc=True)
        address = await server.start(f"unix:{tmp_path / 'ipc.sock'}")
        client = await RpcClient.connect(address, cuda_ipc=True)
        try:
            for i in range(1, 11):
                x = torch.randn(i, 64)
                _, out = await client.call(Speculate([]), SpeculateReply, {"x": x})
                assert torch.equal(out["y"], x * 2) and int(out["n"]) == i
                assert fake.table == {}  # the server opened the call's handle, the client the reply's
                assert client.ipc is not None and len(client.ipc.kept) == 1
                x.zero_()
                assert torch.equal(seen[-1] * 2, out["y"])  # the server's copy is its own
        finally:
            await client.close()
            await server.close()

    run(main())
    assert fake.shared == fake.opened == 30  # 10 calls: the request's tensor, the reply's two
