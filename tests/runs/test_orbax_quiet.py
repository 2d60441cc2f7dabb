"""The reports of reads a failed restore abandons are dropped inside abandoned_reads_hushed,
and nothing else is."""
import asyncio
import gc
import logging

import pytest

from models.orbax_quiet import _drop_orbax_unretrieved, abandoned_reads_hushed, failed_writes_hushed


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


def _unretrieved_record(error: Exception) -> logging.LogRecord:
    """asyncio's report of a future that TensorStore's C++ side failed: no traceback."""
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 0,
                             "Future exception was never retrieved", None,
                             (type(error), error, None))


def test_after_a_failed_write_tensorstore_write_errors_are_dropped_for_good():
    """A write the failure abandoned may be collected at exit, long after the block: its
    report (a TensorStore error, no traceback) is dropped from then on; others still pass."""
    logger = logging.getLogger("asyncio")
    try:
        with pytest.raises(OSError), failed_writes_hushed():
            raise OSError(28, "No space left on device")
        [drop] = [f for f in logger.filters if f is _drop_orbax_unretrieved]
        assert not drop(_unretrieved_record(ValueError(
            'RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database')))
        assert drop(_unretrieved_record(ValueError("a user's own future failed")))
    finally:
        logger.removeFilter(_drop_orbax_unretrieved)
