"""Target discovery without the services: the hosts file, the resolver, and the pool's replica set.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_discovery.py.
"""

from __future__ import annotations

import asyncio

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.perf.cost import PassCost
from specserve.gateway.sched.slo_classes import SloClass
from specserve.shared.wire.messages import SamplingSpec


def latency() -> PassCost:
    return PassCost(24, 10.0, [])


def test_pool_adds_retires_drops_and_reuses_replicas():
    a = TargetReplica(0, "127.0.0.1:1", latency())
    pool = ServicePool([a], None, latency)
    # bound to a replica that is down: the engine ends it, the pool just drops it
    a.requests["r1"] = GenRequest("r1", [1], SamplingSpec(), 4, SloClass("chat", 100.0, 1000.0), frozenset())
    a.owed_releases.add("old")
    pool.set_addresses(["127.0.0.1:1"])
    assert not pool._pending  # the same set: nothing to do
    pool.set_addresses(["127.0.0.1:2"])
    assert pool.needs_reconnect
    asyncio.run(pool.reconnect((OSError, TimeoutError)))  # nothing listens: the new one stays down
    assert [t.address for t in pool.targets] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert [t.index for t in pool.targets] == [0, 1]
    assert a.retired and a.state == "dropped" and not a.owed_releases
    assert not a.view().up and pool.targets[1].state == "down"
    pool.set_addresses(["127.0.0.1:2", "127.0.0.1:1"])  # the old address comes back: the same entry
    asyncio.run(pool.reconnect((OSError, TimeoutError)))
    assert len(pool.targets) == 2 and not a.retired and a.state == "down"


def test_gateway_exits_1_when_the_target_name_resolves_to_nothing(tmp_path):
    import subprocess
    import sys

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 draft\n")
    out = subprocess.run([sys.executable, "-m", "specserve.cli", "gateway", "--port", "0", "--discover-targets",
                          "--target", "no-such-target.invalid:8102", "--hosts-file", str(hosts),
                          "--profile", str(tmp_path / "profile.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "error: cannot reach the services" in out.stderr and "resolve to no address" in out.stderr, out.stderr
