"""What an HTTP front end asks of the engine (`local.py`: `EngineApi`, and `LocalEngine`, the engine
in the same process), and HTTP front ends in processes of their own (`--frontends N`).

With `--frontends N` (N >= 1) the gateway process runs the engine (admission, policy, the
per-replica step loops) and no HTTP server; N front-end processes serve the OpenAI API on the
same port (SO_REUSEPORT), each parsing, tokenizing, detokenizing and streaming its own clients'
requests, and exchange compact typed messages with the engine over a Unix socket:

- `wire.py`: the messages (msgspec) and their length-prefixed frames;
- `link.py`: the engine's side: one connection per front end; a front end that goes away
  costs only its own requests (they are aborted);
- `remote.py`: a front end's side, `RemoteEngine`, what the HTTP handlers call instead of the
  engine in their own process;
- `procs.py`: the engine process starts the front ends, restarts one that dies, stops them.
"""
