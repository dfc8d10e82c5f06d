"""The factories behind the fixtures that start processes: `specserve up` (start_up) and a target and a
draft service on their own (start_services). Each starts what it is asked for and registers its stop
with the fixture's `request`, so a fixture is the few lines that say how its processes differ."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from specserve.shared.host.launch import ServiceProcess
from tests.support.procs import Up

BUDGET_24 = ("--budget", "24")  # B pinned, so that tests do not depend on this machine's timing


def fresh_profile(tmp_path_factory: pytest.TempPathFactory, folder: str = "profile") -> Path:
    """A profile path with no file yet: the `up` started on it measures its target first."""
    return tmp_path_factory.mktemp(folder) / "profile.json"


def start_up(request: pytest.FixtureRequest, *args: str, profile: Path | str,
             gateway_args: Sequence[str] = BUDGET_24, **kw) -> Up:
    """`specserve up *args --profile PROFILE -- *gateway_args` (tests/support/procs.py's Up: the demo pair
    unless args name a model; kw: Up's timeout_s, env, demo), interrupted when the fixture ends."""
    server = Up(*args, "--profile", str(profile), *(("--", *gateway_args) if gateway_args else ()), **kw)
    request.addfinalizer(server.interrupt)
    return server


class ServicePair(NamedTuple):
    target: ServiceProcess
    draft: ServiceProcess


def start_services(request: pytest.FixtureRequest, *args: str) -> ServicePair:
    """A target, then a draft service (specserve.shared.host.launch), both with `args`; stopped, draft first, when the
    fixture ends. A draft that fails to start stops the target before the error goes on."""
    target = ServiceProcess("target", *args)
    try:
        draft = ServiceProcess("draft", *args)
    except BaseException:
        target.stop()
        raise

    def stop() -> None:
        draft.stop()
        target.stop()

    request.addfinalizer(stop)
    return ServicePair(target, draft)
