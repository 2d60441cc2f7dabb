"""The reports of reads a failed restore abandons are dropped inside abandoned_reads_hushed,
and nothing else is."""
import asyncio
import gc
import logging

import pytest

from models.orbax_quiet import abandoned_reads_hushed


async def _fails():
    raise ValueError("OUT_OF_RANGE: a cut-short array file")


def _abandon(kind: str) -> None:
    """Leaves a failed Future or Task nobody retrieves: asyncio logs it when collected."""
    loop = asyncio.new_event_loop()
    try:
        if kind == "task":
            task = loop.create_task(_fails())
            loop.run_until_complete(asyncio.wait([task]))
        else:
            future = loop.create_future()
            future.set_exception(ValueError("OUT_OF_RANGE"))
    finally:
        loop.close()


@pytest.mark.parametrize("kind", ["future", "task"])
def test_unretrieved_reads_are_dropped(kind, caplog):
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(RuntimeError, match="restore failed"):
            with abandoned_reads_hushed(settle_s=0.01, max_wait_s=0.1):
                _abandon(kind)
                raise RuntimeError("restore failed")
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_outside_the_block_they_are_logged(caplog):
    """The filter is gone after the block: the same report is logged (so the test above can fail)."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(RuntimeError):
            with abandoned_reads_hushed(settle_s=0.01, max_wait_s=0.1):
                raise RuntimeError("restore failed")
        _abandon("task")
        gc.collect()
    assert any("Task exception was never retrieved" in r.getMessage() for r in caplog.records)


def test_other_asyncio_errors_still_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with abandoned_reads_hushed(settle_s=0.01, max_wait_s=0.1):
            logging.getLogger("asyncio").error("Unclosed client session")
    assert any("Unclosed client session" in r.getMessage() for r in caplog.records)
