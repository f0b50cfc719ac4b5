"""How a streamed turn's events reach the event loop (``kvstore.api.streams``): in order, in batches
of what arrived meanwhile, ending at ``END``; the items producer threads put while the loop is busy
reach every pipe through one wake-up of the loop."""

from __future__ import annotations

import asyncio
import threading

from kvstore.api.streams import EventPipe


def test_events_put_together_reach_every_pipe_through_one_wake_up():
    async def scenario() -> tuple[list[list[list[int]]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # the real call, counted
        pipes = [EventPipe() for _ in range(8)]

        def step(tokens: list[int], end: bool = False) -> None:
            for pipe in pipes:  # a scheduler step: every turn's token at once
                for token in tokens:
                    pipe.put(token)
                if end:
                    pipe.close()

        # the loop is busy (blocked in this thread's join) while the producer puts: one wake-up
        producer = threading.Thread(target=step, args=([1, 2],))
        producer.start()
        producer.join()
        assert wakeups == 1
        received: list[list[list[int]]] = [[] for _ in pipes]

        async def consume(i: int) -> None:
            async for batch in pipes[i].batches():
                received[i].append(batch)

        consumers = [asyncio.create_task(consume(i)) for i in range(len(pipes))]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        later = threading.Thread(target=step, args=([3], True))
        later.start()
        later.join()
        await asyncio.gather(*consumers)
        return received, wakeups

    received, wakeups = asyncio.run(scenario())
    # each pipe: what arrived while its consumer waited, in one batch; the END closes it
    assert received == [[[1, 2], [3]]] * 8
    assert wakeups == 2
