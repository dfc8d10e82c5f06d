"""A process's state from /proc: its stat fields, and whether it is alive."""

from __future__ import annotations


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def proc_alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie is dead, only not yet reaped
