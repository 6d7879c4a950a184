"""The next batch read while this one trains: a data source whose samples are read from disk
(`TokenSplit.lazy`), and any on a GPU job (`gradmesh.train.loop.reader`), has each step's
batch gathered, and page-locked where it goes to a GPU, on one background thread while the
step before it runs (numpy's gathers and torch's pinning leave
the interpreter lock while they copy). One batch ahead: enough when the loader is faster than
the step (`gradmesh bench loader` measures it), and no more memory than one batch."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def prefetched(
    items: Iterable[T], fetch: Callable[[T], R], background: bool = True
) -> Generator[tuple[T, R], None, None]:
    """(item, fetch(item)) for each item, the next one fetched on a thread while the caller
    works on this one (in the caller's thread without `background`)."""
    if not background:
        for item in items:
            yield item, fetch(item)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradmesh-prefetch") as pool:
        ahead: tuple[T, Future[R]] | None = None
        for item in items:
            future = pool.submit(fetch, item)  # the next is read while the caller has this one
            if ahead is not None:
                yield ahead[0], ahead[1].result()
            ahead = (item, future)
        if ahead is not None:
            yield ahead[0], ahead[1].result()
