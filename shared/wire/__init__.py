"""How specserve's processes talk: typed messages (messages), length-prefixed frames with raw tensor
bytes (transport) or CUDA IPC handles (cuda_ipc), the request/reply server and client (rpc), the
shared-secret handshake (auth), and the typed clients of the draft and target services (service_client).

May import `specserve.shared.process`; never the runtime, the host or a service.
"""
