"""Every ``async def`` test runs on both event loops dsio supports (tests/conftest.py's loop-factory hook)."""

from __future__ import annotations

import asyncio

import pytest


async def test_async_tests_run_on_the_loop_their_id_names(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    name = request.node.name
    assert name in (
        "test_async_tests_run_on_the_loop_their_id_names[asyncio]",
        "test_async_tests_run_on_the_loop_their_id_names[uvloop]",
    )
    if name.endswith("[uvloop]"):
        import uvloop

        assert isinstance(loop, uvloop.Loop)
    else:
        assert type(loop).__module__.startswith("asyncio.")


def test_the_conftest_offers_both_loops(pytestconfig: pytest.Config, request: pytest.FixtureRequest) -> None:
    factories = pytestconfig.hook.pytest_asyncio_loop_factories(config=pytestconfig, item=request.node)
    assert set(factories) == {"asyncio", "uvloop"}
