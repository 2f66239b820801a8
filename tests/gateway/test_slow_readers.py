"""Slow readers (gateway/slow_readers.py): a stream stuck in a write is cut off, others are not."""

import asyncio

from gateway.slow_readers import SlowReaders


def test_only_a_stream_stuck_in_a_write_past_the_timeout_is_cut_off():
    async def run():
        readers = SlowReaders(timeout_s=5.0)
        aborted = []
        stuck = asyncio.create_task(asyncio.sleep(3600))
        reading = asyncio.create_task(asyncio.sleep(3600))
        stuck_watch = readers.open("stuck", lambda: aborted.append("stuck"))
        stuck_watch._task = stuck
        reading_watch = readers.open("reading", lambda: aborted.append("reading"))
        reading_watch._task = reading
        idle_watch = readers.open("idle", lambda: aborted.append("idle"))  # waits for outputs: not writing
        stuck_watch.start_write()
        reading_watch.start_write()
        start = stuck_watch.writing_since
        assert readers.cut_off_stalled(start + 4.0) == 0
        reading_watch.end_write()
        reading_watch.start_write()  # a later write, that has not been stuck for long
        reading_watch.writing_since = start + 4.0
        assert readers.cut_off_stalled(start + 6.0) == 1
        await asyncio.sleep(0)
        result = aborted, stuck.cancelled(), reading.cancelled(), readers.num_cut_off
        reading.cancel()
        readers.close(idle_watch)
        return result

    aborted, is_stuck_cancelled, is_reading_cancelled, num_cut_off = asyncio.run(run())
    assert aborted == ["stuck"] and is_stuck_cancelled and not is_reading_cancelled and num_cut_off == 1


def test_a_timeout_of_zero_never_watches():
    asyncio.run(asyncio.wait_for(SlowReaders(0.0).run(), 1.0))


def test_a_transport_with_end_call_ends_the_call_itself_and_its_task_is_not_cancelled():
    async def run():
        readers = SlowReaders(timeout_s=1.0)
        ended = asyncio.Event()

        async def end_call():
            ended.set()

        writer = asyncio.create_task(asyncio.sleep(3600))
        watch = readers.open("r", lambda: None, end_call)
        watch._task = writer
        watch.start_write()
        assert readers.cut_off_stalled(watch.writing_since + 2.0) == 1
        await asyncio.wait_for(ended.wait(), 1.0)
        result = writer.cancelled()
        writer.cancel()
        return result

    assert asyncio.run(run()) is False
