"""What handing a streamed turn's tokens to the event loop costs, per token, in one run.

    python bench/event_pipe.py [--turns 64] [--steps 200]

``--turns`` producer threads (a streamed turn's reader each) put one item per scheduler step into
their :class:`kvstore.api.streams.EventPipe`, all at the same step (a barrier, then a 2 ms pause: a
step's length), while one async consumer per pipe drains its batches, as the SSE responses do. The
process's CPU per item is printed beside the same harness with no pipe (the barrier's own cost):
their difference is what the pipe costs the server per streamed token, the GIL held that long.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from kvstore.api.streams import EventPipe


async def run(turns: int, steps: int, piped: bool) -> float:
    """CPU microseconds per item: ``turns`` threads putting ``steps`` items each (or only meeting
    at the barrier when not ``piped``)."""
    pipes = [EventPipe() for _ in range(turns)]
    got = [0] * turns

    async def consume(i: int) -> None:
        async for batch in pipes[i].batches():
            got[i] += len(batch)

    consumers = [asyncio.create_task(consume(i)) for i in range(turns)]
    barrier = threading.Barrier(turns + 1)

    def produce(i: int) -> None:
        for step in range(steps):
            barrier.wait()
            if piped:
                pipes[i].put(("token", step))
        pipes[i].close()

    def scheduler() -> None:
        for _ in range(steps):
            barrier.wait()
            time.sleep(0.002)

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(turns)]
    threads.append(threading.Thread(target=scheduler))
    began = time.process_time()
    for thread in threads:
        thread.start()
    await asyncio.gather(*consumers)
    for thread in threads:
        thread.join()
    cpu = time.process_time() - began
    assert sum(got) == (turns * steps if piped else 0)
    return cpu / (turns * steps) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    piped = sorted(asyncio.run(run(args.turns, args.steps, True)) for _ in range(args.reps))
    bare = sorted(asyncio.run(run(args.turns, args.steps, False)) for _ in range(args.reps))
    p, b = piped[len(piped) // 2], bare[len(bare) // 2]
    print(f"{args.turns} turns x {args.steps} steps, medians of {args.reps}: CPU per item {p:.1f} us with the pipe, "
          f"{b:.1f} us without (the harness): the pipe {p - b:.1f} us a streamed token")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
