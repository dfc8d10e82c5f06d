"""A service started by `specserve up` (or any `specserve.shared.host.launch.ServiceProcess`) dies with its parent.

The parent puts its pid into the child's environment (`child_environment`); the child calls
`follow_parent()` first thing. Then, even if the parent is SIGKILLed:
- on Linux the kernel sends the child SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG). Linux
  sends it when the parent *thread* that started the child exits, so the parent asks for it only
  when it starts the child from its main thread, which lives as long as the process;
- a watchdog thread checks every `POLL_S` that the parent pid is still the one it was told, which
  covers the parent dying before the prctl call, children started from other threads, and
  platforms without prctl.
Either way the child stops as on Ctrl-C (SIGTERM to itself: connections closed, exit 0), and is
killed outright if it has not exited `GRACE_S` later. A service started by hand (no variable) is
not affected. The variables are removed from the child's environment, so its own children are not
bound to the wrong parent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping

PARENT_PID_VAR = "SPECSERVE_PARENT_PID"
DEATH_SIGNAL_VAR = "SPECSERVE_PARENT_DEATH_SIGNAL"  # "1": ask the kernel for SIGTERM on the parent's death
POLL_S = 0.5  # the watchdog's period
GRACE_S = 10.0  # after the SIGTERM, then the watchdog exits the process itself
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("specserve")


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` plus what a child needs to follow this process (the caller's pid, and the death
    signal when called from the main thread)."""
    env = dict(environ, **{PARENT_PID_VAR: str(os.getpid())})
    env.pop(DEATH_SIGNAL_VAR, None)
    if threading.current_thread() is threading.main_thread():
        env[DEATH_SIGNAL_VAR] = "1"
    return env


def follow_parent(environ: MutableMapping[str, str] | None = None) -> int | None:
    """In a child started with `child_environment`: stop when the parent is gone. Returns the
    parent's pid, or None when this process was not started that way (nothing is set up)."""
    env = os.environ if environ is None else environ
    text = env.pop(PARENT_PID_VAR, None)
    death_signal = env.pop(DEATH_SIGNAL_VAR, None) == "1"
    if not text or not text.isdigit():
        return None
    parent = int(text)
    if death_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watchdog alone
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        print(f"error: the parent process (pid {parent}) is gone", file=sys.stderr, flush=True)
        raise SystemExit(1)
    threading.Thread(target=_watch, args=(parent,), name="parent-watchdog", daemon=True).start()
    return parent


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.warning("the parent process (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
