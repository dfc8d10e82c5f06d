"""Target discovery without the services: the hosts file, the resolver, and the pool's replica set.

The end-to-end behaviour (a replica that joins serves; one that leaves while serving is drained,
with the same greedy output and no KV left behind) is in test_compose.py, on real processes.

Here: the tests that start no process and open no socket; the others are in tests/service/test_discovery.py.
"""

from __future__ import annotations

import asyncio

from specserve.gateway.backends.discovery import Resolver, TargetDiscovery, read_hosts, split_address


def test_hosts_file_lists_every_address_of_a_name(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\n127.0.0.2 target replica-a  # trailing comment\n127.0.0.3 target\n"
                     "127.0.0.2 target\n\n127.0.0.9 draft\n")
    assert read_hosts(str(hosts)) == {"target": ["127.0.0.2", "127.0.0.3"], "replica-a": ["127.0.0.2"],
                                      "draft": ["127.0.0.9"]}
    r = Resolver(str(hosts))
    assert asyncio.run(r.resolve_address("Target:8102")) == ["127.0.0.2:8102", "127.0.0.3:8102"]
    assert asyncio.run(r.resolve_address("unix:/run/specserve/target.sock")) == ["unix:/run/specserve/target.sock"]
    assert asyncio.run(r.first("draft:8101")) == "127.0.0.9:8101"
    assert asyncio.run(r.first("elsewhere:8101")) == "elsewhere:8101"  # left to the system at connect
    assert asyncio.run(r.resolve_address("localhost:8102"))  # not in the file: DNS (getaddrinfo)
    assert split_address("[::1]:8102") == ("::1", 8102)


def test_a_failed_lookup_keeps_the_replicas(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 target\n")
    found = asyncio.run(TargetDiscovery(["target:8102", "no-such-name.invalid:8102"], Resolver(str(hosts)),
                                        1.0).addresses())
    assert found is None
    assert asyncio.run(TargetDiscovery(["target:8102"], Resolver(str(hosts)), 1.0).addresses()) == ["127.0.0.2:8102"]
