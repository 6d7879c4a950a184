"""A sync parameter server declares a silent worker lost, goes on without it, and readmits it
when it speaks again: its gradient joins the round under way and its read waits for that round,
as the other worker's does (a real server, real clients over TCP)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gradmesh.sync.parameter_server.client import Client
from gradmesh.sync.parameter_server.server import Server
from gradmesh.sync.parameter_server.serving import ServerConfig

TOKEN = bytes(range(16))
NUMEL = 8
LR = 0.05  # the server's SGD


def in_thread(work: Any) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_a_worker_declared_lost_is_readmitted_into_the_round_under_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = ServerConfig.of(0, 2, NUMEL, timeout_s=20, mode="sync", lost_after_s=3.0, lr=LR)
    server = Server(config, TOKEN, "127.0.0.1")
    stats: list[dict[str, Any]] = []
    serving = in_thread(lambda: stats.append(server.serve()))
    try:
        fast, slow = (Client([server.endpoint], TOKEN, w, NUMEL, timeout_s=20) for w in (0, 1))
        values = torch.zeros(NUMEL)
        fast.init(values)
        slow.init(values)
        out = [torch.zeros(NUMEL), torch.zeros(NUMEL)]
        ones = torch.ones(NUMEL)
        # step 1 with both
        both = in_thread(lambda: slow.pull(out[1], push=ones))
        fast.pull(out[0], push=ones)
        both.join(timeout=20)
        assert server.version == 1
        # the slow worker goes quiet: step 2's round closes without it once it is lost, then step 3
        fast.pull(out[0], push=ones)
        fast.pull(out[0], push=ones)
        assert server.version == 3
        assert "worker 1 lost" in capsys.readouterr().out
        # it speaks again with its step 2: readmitted, its gradient joins round 4 and its read waits
        back = in_thread(lambda: slow.pull(out[1], push=2 * ones))
        deadline = time.monotonic() + 2.0  # the other worker stays within its 3 s
        while 1 not in server.round and time.monotonic() < deadline:
            time.sleep(0.01)  # until its push is in the round (a fixed pause could end first)
        assert 1 in server.round, "its push did not join the round under way"
        assert back.is_alive(), "its read was answered before the round it joined had closed"
        fast.pull(out[0], push=ones)  # step 4 of the other worker closes that round
        back.join(timeout=20)
        assert not back.is_alive() and server.version == 4
        # rounds 1 and 4 averaged both (1 and 1.5), rounds 2 and 3 the fast worker's alone (1 each)
        assert torch.allclose(out[0], torch.full((NUMEL,), -LR * 4.5))
        assert torch.equal(out[0], out[1])
        assert "worker 1 is back after" in capsys.readouterr().out
        # both finish: the server waits for the readmitted worker and reports no one lost
        done = in_thread(lambda: slow.finish({"samples": 1, "wall_s": 1.0}))
        summary = fast.finish({"samples": 1, "wall_s": 1.0})
        done.join(timeout=20)
        assert summary[0]["lost_workers"] == [] and summary[0]["readmitted_workers"] == [1]
        fast.close_servers()
        for client in (fast, slow):
            client.close()
    finally:
        server.closed = True  # ends the loop at its next poll whatever happened above
        serving.join(timeout=20)
    assert not serving.is_alive() and stats


@contextlib.contextmanager
def served(config: ServerConfig) -> Iterator[tuple[Server, threading.Thread]]:
    """A server on loopback, serving in a thread; ended at its next poll afterwards whatever
    happened."""
    server = Server(config, TOKEN, "127.0.0.1")
    serving = in_thread(server.serve)
    try:
        yield server, serving
    finally:
        server.closed = True
        serving.join(timeout=20)


def test_the_job_ends_when_its_reporter_closes_not_on_a_timer() -> None:
    """A worker never heard from is lost after `timeout_s`; the reporter, starved past
    `lost_after_s` after DONE, still gets its final pull; its connection closing (it died before
    CLOSE), the last DONE went on, ends the server at once, not after `timeout_s`."""
    config = ServerConfig.of(0, 2, NUMEL, timeout_s=6, mode="async", lost_after_s=0.5, lr=LR)
    with served(config) as (server, serving):
        reporter = Client([server.endpoint], TOKEN, 0, NUMEL, timeout_s=20)
        values = torch.arange(NUMEL, dtype=torch.float32)
        reporter.init(values)
        summary = reporter.finish({"samples": 1, "wall_s": 1.0})  # worker 1 never speaks
        assert summary[0]["lost_workers"] == [1] and summary[0]["reporter"] == 0
        time.sleep(4 * config.ps.lost_after_s)  # within timeout_s
        out = torch.zeros(NUMEL)
        reporter.pull(out)
        assert torch.equal(out, values), "the final pull did not get the model"
        assert serving.is_alive()
        reporter.close()
        serving.join(timeout=3)  # the quiet timer would end it 6 s after the pull
        assert not serving.is_alive(), "the reporter's connection closing did not end the server"


def test_a_worker_back_after_done_gets_done_and_a_finish_closes_a_sync_round() -> None:
    """async: a worker declared lost that finishes after DONE is answered with DONE (it used
    to wait for a summary that never came). sync: a round waiting only for a worker that
    finishes instead of pushing closes at its FINISH (it waited for the timeout)."""
    config = ServerConfig.of(0, 2, NUMEL, timeout_s=20, mode="async", lost_after_s=0.5, lr=LR)
    with served(config) as (server, serving):
        first, late = (Client([server.endpoint], TOKEN, w, NUMEL, timeout_s=20) for w in (0, 1))
        first.init(torch.zeros(NUMEL))
        late.pull(torch.zeros(NUMEL))
        time.sleep(4 * config.ps.lost_after_s)  # lost: the first worker finishes without it
        assert first.finish({"samples": 1, "wall_s": 1.0})[0]["lost_workers"] == [1]
        summary = late.finish({"samples": 1, "wall_s": 1.0})  # a timeout error before the fix
        assert summary[0]["reporter"] == 0
        first.close_servers()
        for client in (first, late):
            client.close()
        serving.join(timeout=10)
        assert not serving.is_alive()

    config = ServerConfig.of(0, 2, NUMEL, timeout_s=20, mode="sync", lr=LR)
    with served(config) as (server, serving):
        pusher, quitter = (Client([server.endpoint], TOKEN, w, NUMEL, timeout_s=5) for w in (0, 1))
        pusher.init(torch.zeros(NUMEL))
        quitter.pull(torch.zeros(NUMEL))
        read = torch.zeros(NUMEL)
        step = in_thread(lambda: pusher.pull(read, push=torch.ones(NUMEL)))
        deadline = time.monotonic() + 10
        while 0 not in server.round and time.monotonic() < deadline:
            time.sleep(0.01)
        done = in_thread(lambda: quitter.finish({"samples": 1, "wall_s": 1.0}))
        step.join(timeout=5)  # the pusher's client times out at 5 s before the fix
        assert server.version == 1 and torch.allclose(read, torch.full((NUMEL,), -LR))
        pusher.finish({"samples": 1, "wall_s": 1.0})
        done.join(timeout=10)
        pusher.close_servers()
        for client in (pusher, quitter):
            client.close()
