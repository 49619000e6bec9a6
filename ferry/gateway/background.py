"""A long-lived asyncio task owned by one object: a worker's monitor, a KV-event subscriber.

The gateway keeps several loops running beside the requests; each needs the
same three things, kept here so they behave alike: `start` runs the owner's
`_run` as a named task (the name tells the tasks apart in asyncio's task
listings), `stop` cancels it and waits until it has ended (nothing of it runs
after `stop` returns), and `running` says whether it is still alive (a loop
that raised has ended, and its owner's state may be stale).
"""

from __future__ import annotations

import asyncio


class BackgroundTask:
    def __init__(self, name: str) -> None:
        self.task_name = name
        self.task: asyncio.Task | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()
