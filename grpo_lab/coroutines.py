"""Awaiting coroutines from synchronous code: reward functions and tools may be ``async def``, and
the stages that call them are not (in a notebook they run inside Jupyter's event loop)."""

from __future__ import annotations

import asyncio
import threading


def run_coroutines(coroutines):
    """Await coroutines concurrently, also from inside a running event loop (Jupyter)."""

    async def gather():
        return await asyncio.gather(*coroutines)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(value=asyncio.run(gather())))
    thread.start()
    thread.join()
    return outcome["value"]
