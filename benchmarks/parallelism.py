"""Does this machine run two single-threaded processes in parallel right now?

    python benchmarks/parallelism.py

Times 200 products of 512x512 matrices in one process alone, then in two processes at once, three
times. A parallel speed-up of 2x means a core each, as the planner assumes of its devices; on a
busy shared machine it can fall below 1x (the two processes together take longer than one after
the other), and pipeline speed-ups and the planner's predictions with it.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


def work(queue: mp.Queue[float]) -> None:
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(200):
        a @ a
    queue.put(time.perf_counter() - start)


def main() -> None:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    for _ in range(3):
        alone = ctx.Process(target=work, args=(queue,))
        alone.start()
        alone.join()
        single = queue.get()
        pair = [ctx.Process(target=work, args=(queue,)) for _ in range(2)]
        start = time.perf_counter()
        for p in pair:
            p.start()
        for p in pair:
            p.join()
        both = time.perf_counter() - start
        queue.get(), queue.get()
        print(
            f"one process alone {single:.2f} s, two at once {both:.2f} s: parallel speed-up {2 * single / both:.2f}x "
            "(2.0 = a core each)"
        )


if __name__ == "__main__":
    main()
