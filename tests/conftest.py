"""Suite-wide settings and fixtures, and the tiers.

The tests are in folders by what they start: tests/unit (no processes, no sockets), tests/service (one
or two real services or processes), tests/stack (the whole stack: `specserve up`, a gateway with its
services, compose, the bench). The fast tier (`bash scripts/test.sh --fast`) is tests/unit and the one
request end to end through the three services (`@pytest.mark.fast`, in tests/stack/test_gateway.py):
every test under tests/service and tests/stack that is not marked `fast` is marked `slow` here, so
`-m "not slow"` selects the fast tier too. A test module outside the three folders, or a test in
tests/unit that uses a fixture that starts services (SERVICE_FIXTURES, directly or through another
fixture), is a collection error.
"""

from __future__ import annotations

import os
import secrets
import shutil

# Triton kernels run through Triton's interpreter on CPU tensors where there is no GPU. Triton reads this
# when its own library is defined, so it is set before anything imports triton (torch and transformers may).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve.shared.runtime.model_store import unpack_bundled  # noqa: E402

# Fixtures shared by modules of several tiers: the CPU kernel variants and a tiny model with its GGUF file.
pytest_plugins = ["tests.support.gguf_model"]

# One shared secret for the whole run (shared/wire/auth.py), set before anything starts: every test, the
# services and gateways it starts (they inherit the environment) and its clients use it.
os.environ.setdefault("SPECSERVE_SECRET", secrets.token_hex(32))

# The bundled models' weights, committed compressed, written out where the install step has not (transformers
# reads models/target directly in the parity tests).
unpack_bundled()


# Fixtures that start `specserve up` or separate services: not in tests/unit.
SERVICE_FIXTURES = {"up", "up2", "services", "stack", "traced_up", "run12", "real_up", "simulated_up", "drafting_up",
                    "up_eagle", "up_ngram", "up_fe"}
TIERS = ("unit", "service", "stack")
TESTS = Path(__file__).resolve().parent


def tier_of(item: pytest.Item) -> str | None:
    """The tier folder a test is in (None: outside the three)."""
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        tier = tier_of(item)
        if tier is None:
            misplaced.append(f"{item.nodeid}: not in tests/unit, tests/service or tests/stack")
        elif tier == "unit":
            uses = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            if uses or item.get_closest_marker("slow") or item.get_closest_marker("fast"):
                misplaced.append(f"{item.nodeid}: in tests/unit but starts services ({', '.join(sorted(uses))}) "
                                 "or is marked slow or fast")
        elif item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.slow)
    if misplaced:
        raise pytest.UsageError("tests in the wrong tier folder:\n  " + "\n  ".join(misplaced))


@pytest.fixture(autouse=True, scope="session")
def single_intra_op_thread():
    """The test models are tiny: one intra-op thread is fastest, and immune to OpenMP workers
    spinning against other processes on a 2-core machine (that made modules 6-20x slower).
    Subprocesses started by tests (the CLI, services) keep their own settings."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def suite_profile(tmp_path_factory) -> Path:
    """One profile of the demo target for the suite's `up`s: the first to start measures it (about
    10 s; tests/stack/test_gateway.py checks that measurement with a fresh file of its own), the others read it."""
    return tmp_path_factory.mktemp("profile") / "profile.json"


@pytest.fixture(scope="module")
def up(request, suite_profile):
    """`specserve up` for a test module, on the suite's profile; B is pinned to 24 so the tests do not
    depend on this machine's timing. (tests/stack/test_gateway.py and tests/stack/test_bench.py start
    their own.)"""
    from tests.support.fixtures import start_up

    return start_up(request, profile=suite_profile)


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """transformers' greedy output of the target alone on tests/support/gateway.py's PROMPTS."""
    from tests.support.gateway import transformers_greedy

    return transformers_greedy()


@pytest.fixture(scope="module")
def services(request):
    """A target and a draft service on their own, (target, draft). (test_auth.py and test_services.py
    start theirs with other settings.)"""
    from tests.support.fixtures import start_services

    return start_services(request)


@pytest.fixture(scope="module")
def prompts_and_reference():
    """The first three PROMPTS as token ids with the target's greedy continuations (tests/support/engine.py's
    MAX_TOKENS tokens), and the target's stop ids."""
    from tests.support.engine import reference_tokens

    return reference_tokens()
