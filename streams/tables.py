"""The stage workers' faust table manager: faust's own, without its start-up pause.

faust's ``TableManager.on_start`` sleeps 1 s before it finalises the tables (so that tables
declared late, after the app started, still make it) and only then lets the consumer
subscribe: every worker start, and so every test and restart that waits for a worker, paid
that second. The stage workers declare no faust table (their state is in Postgres), and every
agent is registered by :func:`streams.app.create_app` before the worker starts, so there is
nothing to wait for.
"""

from __future__ import annotations

from faust.tables import TableManager


class NoTablesManager(TableManager):
    """:class:`faust.tables.TableManager` that finalises the tables at once on start (the app
    has none; a table declared after the start still fails, "Too late to add tables")."""

    async def on_start(self) -> None:
        """Finalise the (absent) tables and start recovery, without faust's 1 s pause."""
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()
