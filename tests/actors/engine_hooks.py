"""Engines for `FLOWENGINE_TEST_ENGINE=engine_hooks:NAME` (the server tests of this folder
start `flowengine serve` with tests/actors on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

from flowengine.entrypoints.async_engine import AsyncEngine


class OneLifeEngine(AsyncEngine):
    """A multiproc `AsyncEngine` whose supervisor may not restart the group: the first
    death of an engine or executor process makes the engine dead for good."""

    async def _start(self) -> None:
        await super()._start()
        self.supervisor.max_restarts = 0


def one_life_engine(args: Any) -> AsyncEngine:
    return OneLifeEngine.from_engine_args(args)
