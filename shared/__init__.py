"""Code used by more than one specserve process, in packages by job.

From the bottom up (a package imports only those below it; import-linter checks it, pyproject.toml):
- `spec`: speculative decoding's pure parts: sampling, token trees, lossless tree acceptance, feature logs;
- `process`: what every process needs: settings from flags and environment, tracing, ports, dying with
  its parent;
- `runtime`: the model runtime: the Llama-family model, attention, the paged KV cache, the runner, the
  loader and named models, GGUF weights, the compiled CPU operators and CUDA graphs;
- `wire`: how processes talk: typed messages, frames, CUDA IPC, the RPC server and client, the
  handshake, the services' typed clients;
- `simulate`: the simulated model services' latency and acceptance models;
- `host`: launching child services, and the serving loop, flags and metrics that the draft and target
  services share.
"""
