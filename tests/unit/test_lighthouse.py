"""The lighthouse's quorum rounds and commit votes, driven by threads (and once over TCP)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from gradmesh.errors import GradmeshError
from gradmesh.launch.ports import free_port
from gradmesh.sync.replicas.lighthouse import MAX_LINE, Lighthouse, LighthouseConfig, Rounds, run
from gradmesh.sync.replicas.manager import ask

JOB = "model gpt, 1 workers, batch 24, abc"


def rounds(
    groups: int = 3,
    min_groups: int = 2,
    join: float = 5.0,
    quorum: float = 10.0,
    start: float = 5.0,
) -> Rounds:
    """Rounds that wait 5 s for a member that is not there (a thread that asks "at once" can be
    held that long on a busy machine, which must not change a round's members); a test that
    means a member to be absent passes short timeouts (`ABSENT`)."""
    return Rounds(groups, min_groups, join, quorum, commit_timeout_s=2.0, start_timeout_s=start)


ABSENT: dict[str, float] = {"join": 0.3, "start": 0.3}
"""The timeouts of a test whose round goes on without a member that never asks."""


def asking(r: Rounds, asks: list[tuple[int, int]], identity: str = JOB) -> dict[int, Any]:
    """Each (group, step) asks at once on its own thread; their answers by group."""
    answers: dict[int, Any] = {}

    def one(group: int, step: int) -> None:
        answers[group] = r.quorum(group, step, identity, False)

    threads = [threading.Thread(target=one, args=a) for a in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return answers


def test_the_first_round_waits_for_every_group_and_answers_all_alike() -> None:
    r = rounds()
    answers = asking(r, [(0, 0), (1, 0), (2, 0)])
    assert len({str(a) for a in answers.values()}) == 1
    decision = answers[0]
    assert decision["members"] == [0, 1, 2] and decision["max_step"] == 0
    again = asking(r, [(0, 1), (1, 1), (2, 1)])[0]
    assert again["quorum_id"] == decision["quorum_id"]  # the same members: the same group
    # a member whose step failed asks for a new process group
    fresh: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda g=g: fresh.setdefault(g, r.quorum(g, 2, JOB, g == 1)))
        for g in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert fresh[0]["quorum_id"] == decision["quorum_id"] + 1


def test_the_first_round_waits_for_a_late_group_up_to_the_start_timeout() -> None:
    """Groups start seconds apart (each imports torch): a group later than the join timeout is
    still in the first quorum; past the start timeout the minimum goes on without it."""
    r = rounds(join=0.2, start=3.0)
    late: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda g=g: late.setdefault(g, r.quorum(g, 0, JOB, False)))
               for g in (0, 1)]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(0.6)  # three join timeouts
    assert not late  # still waiting for group 2
    third = r.quorum(2, 0, JOB, False)
    for t in threads:
        t.join(timeout=10)
    assert third["members"] == late[0]["members"] == [0, 1, 2]
    quick = rounds(join=0.2, start=0.5)
    started = time.monotonic()
    answers = asking(quick, [(0, 0), (1, 0)])
    assert answers[0]["members"] == [0, 1] and time.monotonic() - started >= 0.5


def test_a_lost_member_is_dropped_after_the_join_timeout() -> None:
    r = rounds(join=1.5)
    asking(r, [(0, 0), (1, 0), (2, 0)])
    started = time.monotonic()
    answers = asking(r, [(0, 5), (1, 5)])  # group 2 is gone
    waited = time.monotonic() - started
    assert answers[0]["members"] == [0, 1] and answers[1] == answers[0]
    assert waited >= 1.5  # not before the timeout
    started = time.monotonic()
    asking(r, [(0, 6), (1, 6)])  # the new quorum's members are all here: no wait
    assert time.monotonic() - started < 1.5


def test_a_group_behind_recovers_from_the_lowest_group_at_the_highest_step() -> None:
    r = rounds()
    asking(r, [(0, 0), (1, 0), (2, 0)])
    answers = asking(r, [(0, 9), (1, 9), (2, 0)])  # group 2 restarted
    assert answers[2]["max_step"] == 9 and answers[2]["source"] == 0
    assert answers[2]["steps"] == {"0": 9, "1": 9, "2": 0}


def test_no_quorum_below_the_minimum_is_one_line_naming_the_step_and_groups() -> None:
    r = rounds(min_groups=2, join=0.1, quorum=0.5)
    answers = asking(r, [(1, 7)])
    assert answers[1] == {
        "error": "no quorum at step 7: groups [1] asked within 0.5 s, at least 2 of 3 needed"
    }


def test_a_group_of_another_job_is_refused_and_the_others_go_on() -> None:
    r = rounds(**ABSENT)
    asking(r, [(0, 0), (1, 0), (2, 0)])
    other = r.quorum(2, 0, "model cnn, 1 workers, batch 24, def", False)
    assert other["error"].startswith("group 2 at step 0 runs another job (model cnn")
    assert asking(r, [(0, 1), (1, 1)])[0]["members"] == [0, 1]
    # in the first round too: group 0's run is the job's
    first = rounds(groups=2, min_groups=1, **ABSENT)
    answers: dict[int, Any] = {}
    threads = [
        threading.Thread(
            target=lambda g=g, i=i: answers.setdefault(g, first.quorum(g, 0, i, False))
        )
        for g, i in ((0, JOB), (1, "model mlp, 1 workers, batch 24, def"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert answers[0]["members"] == [0] and "not admitted" in answers[1]["error"]


def test_a_step_commits_only_when_every_member_finished_it() -> None:
    r = rounds()
    qid = asking(r, [(0, 0), (1, 0), (2, 0)])[0]["quorum_id"]
    votes: dict[int, Any] = {}

    def vote(group: int, ok: bool) -> None:
        votes[group] = r.commit(group, qid, 0, ok)

    def ballot(oks: dict[int, bool]) -> float:
        votes.clear()
        started = time.monotonic()
        threads = [threading.Thread(target=vote, args=item) for item in oks.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        return time.monotonic() - started

    ballot({0: True, 1: True, 2: True})
    assert all(v == {"commit": True} for v in votes.values())
    r.verdicts.clear()
    r.votes.clear()
    r.vote_opened.clear()
    assert ballot({0: False, 1: True}) < 2.0  # one failure decides at once, not at the timeout
    assert all(v == {"commit": False} for v in votes.values())
    r.verdicts.clear()
    r.votes.clear()
    r.vote_opened.clear()
    assert ballot({0: True, 1: True}) >= 2.0  # a member that never votes: after the timeout
    assert all(v == {"commit": False} for v in votes.values())
    assert r.commit(5, qid, 0, True) == {"error": f"group 5 is not in quorum {qid}"}


def test_over_tcp_requests_are_json_lines_and_bad_ones_one_line() -> None:
    lighthouse = Lighthouse(rounds(groups=1, min_groups=1))
    try:
        decision = ask(
            lighthouse.address,
            {"op": "quorum", "group": 0, "step": 3, "identity": JOB},
            timeout_s=5,
        )
        assert decision["members"] == [0] and decision["store"].startswith("127.0.0.1:")
        with pytest.raises(GradmeshError, match="lighthouse at .*: bad request: unknown op"):
            ask(lighthouse.address, {"op": "pickle", "group": 0}, timeout_s=5)
        with socket.create_connection(("127.0.0.1", lighthouse.port), timeout=5) as conn:
            conn.sendall(b"x" * (MAX_LINE + 10) + b"\n")
            assert b"longer than" in conn.makefile("rb").readline()
    finally:
        lighthouse.close()
    started = time.monotonic()
    with pytest.raises(GradmeshError, match="group 0 at step 3: the lighthouse at .* did not"):
        ask(lighthouse.address, {"op": "quorum", "group": 0, "step": 3}, timeout_s=2, reach_s=1)
    assert 1 <= time.monotonic() - started < 30  # tried again for reach_s, then one line


def test_a_lighthouse_that_comes_up_late_is_reached() -> None:
    """A leader that cannot connect (nothing listens yet, as on a link that is down) tries
    again until it can, within its reach, and nothing is sent twice."""
    port = free_port()
    asked: dict[str, Any] = {}

    def leader() -> None:
        request = {"op": "quorum", "group": 0, "step": 3, "identity": JOB}
        asked["reply"] = ask(f"127.0.0.1:{port}", request, timeout_s=5, reach_s=30)

    thread = threading.Thread(target=leader)
    thread.start()
    time.sleep(1.5)  # three refused connections
    lighthouse = Lighthouse(rounds(groups=1, min_groups=1), port=port)
    try:
        thread.join(timeout=30)
        assert asked["reply"]["members"] == [0]
    finally:
        lighthouse.close()


def test_a_group_restarted_under_its_number_gets_a_new_process_group() -> None:
    """Its old process's connections are dead: the same members, a new quorum id."""
    r = rounds()
    first: dict[int, Any] = {}

    def one(group: int, step: int, incarnation: str, into: dict[int, Any]) -> None:
        into[group] = r.quorum(group, step, JOB, False, incarnation)

    for step, incarnations, into in ((0, "aab", first), (5, "aac", {})):
        threads = [
            threading.Thread(target=one, args=(g, step if g < 2 else 0, inc, into))
            for g, inc in enumerate(incarnations)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    assert r.quorum_id == first[0]["quorum_id"] + 1


def test_a_step_s_slice_keeps_the_global_batch_or_each_group_s_own_slice() -> None:
    """keep: the groups alive split the whole global batch; rescale: each keeps its slice of R
    and the loss counts only the slices of the groups alive."""
    import torch

    from gradmesh.sync.replicas.manager import Quorum
    from gradmesh.train.replicated import _slice

    idx = torch.arange(24, device="cpu")
    quorum = Quorum(4, (0, 2), 1, 9, 0, False, False)  # group 2, with group 0; group 1 lost
    mine, live, replicas = _slice(idx, quorum, 3, 2, True, (1, 2))  # its second in-group rank
    assert mine.tolist() == list(range(18, 24)) and (live, replicas) == (24, 4)
    mine, live, replicas = _slice(idx, quorum, 3, 2, False, (0, 1))
    assert mine.tolist() == list(range(16, 24)) and (live, replicas) == (16, 2)


def test_a_group_that_asks_after_the_run_finished_is_told_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Groups 0 and 1 took the last step and said so; group 2, restarted too late to rejoin,
    asks for a quorum: it hears that the run is over at once (not after the 30 s quorum
    timeout, waiting for groups that will never ask again), over TCP, and its manager ends."""
    from types import SimpleNamespace

    from gradmesh.sync.replicas.manager import ReplicaManager

    r = rounds(quorum=30.0, **ABSENT)
    assert asking(r, [(0, 0), (1, 0)])[0]["members"] == [0, 1]
    lighthouse = Lighthouse(r)
    try:
        finished = [
            ReplicaManager(g, 3, lighthouse.address, JOB, SimpleNamespace(rank=0, size=1))  # type: ignore[arg-type]
            for g in (0, 1)
        ]
        for manager in finished:
            manager.finish(300)
        assert r.finished == {0: 300, 1: 300}
        late = ReplicaManager(2, 3, lighthouse.address, JOB, SimpleNamespace(rank=0, size=1))  # type: ignore[arg-type]
        started = time.monotonic()
        assert late.start_step(0) is None
        said = capsys.readouterr().err
        assert "replica group 2: the run finished at step 300 (groups [0, 1]) before" in said
        assert time.monotonic() - started < 5.0
        assert late.report()["after_the_end"] is True
        late.finish(0)  # a late group reports nothing
        assert r.finished == {0: 300, 1: 300}
        assert r.finish(7, 1) == {"error": "group 7 is not one of the job's 3 groups"}
    finally:
        lighthouse.close()


def test_a_copy_that_fails_mid_way_loads_nothing_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Group 1 restarted (step 0) joins group 0 (step 5): both take part in the copy of group
    0's state over the quorum's own Gloo group. The source fails before it sends (as a link that
    drops would leave it): the group behind waits out the copy's timeout, loads nothing, and each
    group says in one line which copy at which step failed; both will take the step again."""
    from types import SimpleNamespace

    from gradmesh.sync.replicas.manager import ReplicaManager

    r = rounds(groups=2, min_groups=2, quorum=10.0, start=5.0)
    lighthouse = Lighthouse(r)
    loaded: list[Any] = []
    outcome: dict[int, Any] = {}
    # held until both threads end: a manager dropped with its thread closes its process group,
    # and the other group, if it is still connecting to it, sees its peer leave (as a group
    # process that ended would make it, which is not what this test is about)
    managers: list[ReplicaManager] = []

    def broken() -> dict[str, Any]:
        raise RuntimeError("Connection reset by peer\nwhat follows is noise")

    def group(g: int, step: int) -> None:
        rt = SimpleNamespace(rank=0, size=1)
        manager = ReplicaManager(g, 2, lighthouse.address, JOB, rt, timeout_s=2.0)  # type: ignore[arg-type]
        managers.append(manager)
        quorum = manager.start_step(step)
        assert quorum is not None and quorum.recovering and quorum.behind == (g == 1)
        outcome[g] = (manager.recover(broken, loaded.append), manager.reconfigure)

    try:
        threads = [threading.Thread(target=group, args=a) for a in ((0, 5), (1, 0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        lighthouse.close()
    assert outcome == {0: (False, True), 1: (False, True)} and loaded == []
    said = capsys.readouterr().err
    for g in (0, 1):
        assert f"replica group {g}: the copy of group 0's state at step 5 failed (" in said
    assert "Connection reset by peer)" in said and "noise" not in said
    assert said.count("nothing was loaded, the step is taken again with the next quorum") == 2


def test_a_group_of_another_job_is_refused_even_after_the_run_finished() -> None:
    """Which answer a group of another job gets does not depend on when it starts: before or
    after the run's end it is not admitted (a CI run saw it arrive after the end and be told the
    run was over, exit 0)."""
    r = rounds(**ABSENT)
    assert asking(r, [(0, 0), (1, 0)])[0]["members"] == [0, 1]
    r.finish(0, 60)
    other = r.quorum(1, 0, "model mlp, 1 workers, batch 24, def", False)
    assert "runs another job" in other["error"] and "not admitted" in other["error"]
    assert r.quorum(2, 0, JOB, False)["finished"] == 60  # one of this job: told the run is over


@pytest.mark.parametrize(("port", "store_port"), [(99999, 0), (-1, 0), (29600, -3)])
def test_a_port_out_of_range_is_one_line(port: int, store_port: int) -> None:
    with pytest.raises(GradmeshError, match=r"--port and --store-port must be in 0\.\.65535"):
        run(LighthouseConfig(port=port, store_port=store_port, exit_after_s=0.1))
