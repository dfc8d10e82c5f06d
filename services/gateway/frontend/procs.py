"""The engine process's front ends: N processes of `specserve gateway ... --frontend-of unix:SOCKET`.

Each is started with the engine process's own gateway arguments (so it parses, validates and
streams exactly as the engine process would), the fixed HTTP port they share (SO_REUSEPORT: the
kernel spreads new connections over them) and the engine's Unix socket. `start` returns once every
one has printed its ready line. One that exits while the engine runs is started again (at most once a
second); its clients' requests were aborted by the link when its connection ended. `stop` ends them
all with SIGTERM (SIGKILL after the grace period). They follow this process (shared/process/lifeline.py):
if it dies, so do they.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from specserve.shared.host.launch import cli_command, start_async

log = logging.getLogger("specserve.gateway")
RESTART_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0


def frontend_command(argv: list[str], port: int, link: str) -> list[str]:
    """The command of one front end: this gateway's arguments (those after `gateway`), its port and the
    engine's link (unix:/path) last (argparse takes the last of a repeated flag)."""
    rest = argv[argv.index("gateway") + 1:] if "gateway" in argv else argv[1:]
    return cli_command("gateway", *rest, "--port", str(port), "--frontends", "0", "--frontend-of", link)


class Frontends:
    def __init__(self, count: int, command: list[str]):
        self.count, self.command = count, command
        self.procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        for i in range(self.count):
            self.procs[i] = await self._spawn(i)
        self._watchers = [asyncio.create_task(self._watch(i), name=f"frontend-{i}") for i in range(self.count)]

    async def _spawn(self, i: int) -> asyncio.subprocess.Process:
        proc = await start_async(self.command, f"front end {i}")
        log.info("front end %d (pid %d) is ready", i, proc.pid)
        return proc

    async def _watch(self, i: int) -> None:
        while True:
            proc = self.procs[i]
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            log.error("front end %d (pid %d) exited with %s: starting it again", i, proc.pid, code)
            await asyncio.sleep(RESTART_INTERVAL_S)
            if self._stopping:  # the whole gateway is stopping (a signal to its process group reached it too)
                return
            try:
                self.procs[i] = await self._spawn(i)
            except RuntimeError as exc:
                log.error("%s", exc)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in live:
            try:
                await asyncio.wait_for(p.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()

