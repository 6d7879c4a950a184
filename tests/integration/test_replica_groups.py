"""Replica groups without restarts (`gradmesh lighthouse`, `gradmesh train --replica-group`):
a group killed mid-run drops out of the quorum, the others go on, its launcher restarts it and
it copies its state from a peer; every group ends with bit-equal parameters."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from gradmesh.launch import namespaces
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.launch.ports import free_port
from tests.integration.test_cli import ROOT, gradmesh
from tests.zygote import ZYGOTE, Run

GROUPS, STEPS, BATCH = 3, 300, 24
GPT = ["--model", "gpt", "--dataset", "text", "--optimizer", "adamw", "--lr", "0.002"]


def group_flags(
    group: int, lighthouse: str, out: Path, *extra: str, groups: int = GROUPS
) -> list[str]:
    return [
        "train",
        "--workers",
        "1",
        "--batch-size",
        str(BATCH),
        "--replica-group",
        str(group),
        "--replica-groups",
        str(groups),
        "--lighthouse",
        lighthouse,
        "--quorum-timeout-s",
        "5",
        "--json",
        str(out / f"group{group}.json"),
        *extra,
    ]


def lighthouse_flags(
    bind: str,
    port: int,
    min_groups: int = 2,
    start_s: float = 30.0,
    groups: int = GROUPS,
    join_s: float = 1.0,
) -> list[str]:
    return [
        "lighthouse",
        "--start-timeout-s",
        str(start_s),
        "--groups",
        str(groups),
        "--min-groups",
        str(min_groups),
        "--bind",
        bind,
        "--port",
        str(port),
        "--join-timeout-s",
        str(join_s),
        "--quorum-timeout-s",
        "60",
    ]


def fork(argv: list[str], out: Path, name: str, env: dict[str, str] | None = None) -> Run:
    """`gradmesh ARGV` forked from the tests' zygote (tests/zygote.py), started at once; its
    output in `out`/NAME.out and NAME.err."""
    return ZYGOTE.spawn(
        argv, {**os.environ, **(env or {})}, ROOT, out / f"{name}.out", out / f"{name}.err"
    )


def reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"group{g}.json").read_text()) for g in range(GROUPS)]


@pytest.mark.skipif(namespaces.missing_capability() is not None, reason="no network namespaces")
def test_a_group_killed_mid_run_is_dropped_restarted_and_rejoins_bit_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lighthouse on emulated host 0, groups on hosts 1-3 (1 Gbit/s links); group 2's worker
    is killed (SIGKILL) after a random step and restarted by its launcher, which takes longer
    than the lighthouse's 1 s join timeout (a new process that imports torch), so the others go on
    without it first."""
    # >= 270 steps left, each >= 20 ms (group 0 sleeps that long a step, and the others wait
    # for it): the run outlasts group 2's restart, which took up to 21.9 s beside two CPU hogs
    # and another test worker (a new process importing torch on a quarter of a core)
    killed_after = random.randrange(10, 30)
    with EmulatedCluster(hosts=GROUPS + 1, bandwidth="1gbit") as cluster:
        address = f"{cluster.address(0)}:29600"
        lighthouse = cluster.start_on(0, ["gradmesh", *lighthouse_flags(cluster.address(0), 29600)])
        jobs = [
            cluster.start_on(
                g + 1,
                ["gradmesh", *group_flags(g, address, tmp_path, *GPT)]
                + ["--max-steps", str(STEPS), "--max-restarts", "2"],
                # a worker of its own (GRADMESH_WORKER_START=exec): its restart imports torch,
                # longer than the join timeout (a forked one is back within it, never left)
                env={"GRADMESH_FAULT": f"kill:0:{killed_after}", "GRADMESH_WORKER_START": "exec"}
                if g == 2
                else {"GRADMESH_FAULT": "slow:0:20"}
                if g == 0
                else {},
            )
            for g in range(GROUPS)
        ]
        codes = [job.wait(timeout=300) for job in jobs]
        lighthouse.procs[0].terminate()  # SIGTERM: a background shell leaves SIGINT ignored
        lighthouse.wait(timeout=30)
    said = capsys.readouterr()
    assert codes == [0, 0, 0], said.err[-3000:]
    kill = re.search(r"killed after step (\d+) at unix time ([\d.]+)", said.err)
    assert kill is not None and int(kill.group(1)) == killed_after
    killed_at = float(kill.group(2))
    got = reports(tmp_path)
    infos = [r["strategy_info"] for r in got]
    # every group holds the same model at the end
    assert len({i["parameters_sha256"] for i in infos}) == 1
    assert len({r["test_loss"] for r in got}) == 1
    # the other two went on without group 2 and without a restart of their own
    for info in infos[:2]:
        seen = (killed_at, info, said.err[-3000:])
        without = [c for c in info["quorum_changes"] if c["members"] == [0, 1]]
        assert without and without[0]["step"] <= killed_after + 1, seen
        # the step under way when it died (and the rejoin's)
        assert info["aborted_steps"] <= 2, seen
        # the hiccup: the join timeout (1 s) and a step, at most the 5 s collective timeout more
        # (the report leaves the first step out: it waits for the other groups to start, 6.4-7.1
        # s beside two CPU hogs and another test worker)
        assert info["step_s_longest"] < 1 + 5 + 5, seen
    for info in infos[:2]:  # never restarted: each one's own history starts with the job
        assert info["quorum_changes"][0]["step"] == 0
        assert info["quorum_changes"][0]["members"] == [0, 1, 2]
    # group 2 came back by its launcher and copied its state from a peer
    # (how soon is a figure, printed below and in docs/fault_tolerance.md, not a check: a new
    # process importing torch, 3.7 s on a quiet machine, 21.9 s beside two CPU hogs)
    victim = infos[2]
    assert victim["recoveries"] >= 1, victim
    rejoined = victim["quorum_changes"][0]
    assert rejoined["step"] > killed_after and 2 in rejoined["members"], victim
    # the final loss is the undisturbed one's: one worker with the whole global batch
    reference = gradmesh(
        "train",
        "--workers",
        "1",
        "--batch-size",
        str(BATCH),
        *GPT,
        "--max-steps",
        str(STEPS),
        "--json",
        str(tmp_path / "reference.json"),
    )
    assert reference.returncode == 0, reference.stderr
    undisturbed = json.loads((tmp_path / "reference.json").read_text())["test_loss"]
    assert abs(got[0]["test_loss"] - undisturbed) <= 0.02 * undisturbed
    print(
        f"killed after step {killed_after}; survivors' longest step "
        f"{max(i['step_s_longest'] for i in infos[:2]):.2f} s (median "
        f"{infos[0]['step_s_median']:.3f} s), steps taken again "
        f"{[i['aborted_steps'] for i in infos[:2]]}; group 2 rejoined "
        f"{rejoined['unix_time'] - killed_at:.2f} s after its death; test loss "
        f"{got[0]['test_loss']:.4f} against {undisturbed:.4f} undisturbed",
        file=sys.stderr,
    )


def _children(launcher: Run) -> list[psutil.Process]:
    """The launcher's processes alive now (none once it ended)."""
    try:
        return list(psutil.Process(launcher.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _job_processes(launchers: list[Run], seen: set[int]) -> None:
    """Add the launchers' worker processes alive now to `seen`."""
    seen.update(p.pid for launcher in launchers for p in _children(launcher))


def _workers_of(launcher: Run) -> list[int]:
    """The PID of the launcher's training worker, if one is up (at most one: a group is one
    worker): a process of its own (its command names the module), or forked by the launcher's
    forkserver (a grandchild)."""
    workers = []
    for child in _children(launcher):
        with contextlib.suppress(psutil.NoSuchProcess):  # it may end while we look
            fresh = "gradmesh.train.worker" in " ".join(child.cmdline())
            if fresh or child.ppid() != launcher.pid:
                workers.append(child.pid)
    return workers


def _alive(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_20_random_kills_end_without_a_hang_or_an_orphan(tmp_path: Path) -> None:
    """Three groups of the default CNN (each step made >= 60 ms long: the 300 steps last 18 s
    or more, the kills at most 12 s and as long as the restarts take); every 0.2-0.6 s the
    worker of a random group that has one up is killed with SIGKILL, 20 times; the launchers
    restart them. The job ends within a bounded time, every group with the same parameters,
    and no process of the job is left. The average across groups is int8 with error feedback,
    so steps taken again (its residual put back) and groups rejoining with none are part of it."""
    port = free_port()
    # the first step goes on with whichever group asks first, as every later one does:
    # kills land from the start, and a group killed before its first step joins later
    lighthouse = fork(lighthouse_flags("127.0.0.1", port, 1, 1.0), tmp_path, "lighthouse")
    launchers = [
        fork(
            group_flags(g, f"127.0.0.1:{port}", tmp_path, "--max-steps", "300")
            + ["--max-restarts", "30", "--compression", "int8"],
            tmp_path,
            f"group{g}",
            env={"GRADMESH_FAULT": "slow:0:60"},
        )
        for g in range(GROUPS)
    ]
    kills, started, seen = 0, time.monotonic(), set[int]()
    try:
        while kills < 20 and time.monotonic() - started < 150:
            time.sleep(random.uniform(0.2, 0.6))
            _job_processes(launchers, seen)
            # a random group of those with a worker up now (a group restarting has none: a
            # pick of it would only wait)
            victims = [w for launcher in launchers for w in _workers_of(launcher)]
            if victims:
                os.kill(random.choice(victims), signal.SIGKILL)
                kills += 1
        killing = time.monotonic() - started
        while any(launcher.poll() is None for launcher in launchers):
            _job_processes(launchers, seen)
            assert time.monotonic() - started < 300, "the job hung"
            time.sleep(0.5)
        seconds = time.monotonic() - started
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
        lighthouse.kill()
        lighthouse.wait(timeout=30)
    errors = [launcher.err.read_text()[-2000:] for launcher in launchers]
    assert kills == 20
    assert [launcher.returncode for launcher in launchers] == [0, 0, 0], errors
    time.sleep(1)
    assert _alive(seen) == []  # no orphans: every worker ended with its launcher
    assert ZYGOTE.left_behind() == []
    got = reports(tmp_path)
    # every group that took the last step holds the same model (one restarted after the end
    # is told so by the lighthouse and trains nothing)
    ended = [r for r in got if not r["strategy_info"]["after_the_end"]]
    assert ended and len({r["strategy_info"]["parameters_sha256"] for r in ended}) == 1
    recovered = sum(r["strategy_info"]["recoveries"] for r in got)
    print(
        f"{kills} kills in {killing:.0f} s, the job's end {seconds:.0f} s after its start; the "
        f"groups' last processes recovered {recovered} times from a peer (0 where every group "
        "was down at once and all began again)",
        file=sys.stderr,
    )


def test_no_quorum_and_a_group_of_another_run_are_one_line_each(tmp_path: Path) -> None:
    """A group alone where two are needed stops after the lighthouse's quorum timeout, naming
    the step and the groups; a group whose model differs is refused, naming it and its step,
    while the other trains on to its end; a group that asks after that end ends at once."""
    port = free_port()
    flags = lighthouse_flags("127.0.0.1", port, 2)
    flags[flags.index("--quorum-timeout-s") + 1] = "3"
    lighthouse = fork(flags, tmp_path, "lighthouse")
    try:
        alone = gradmesh(*group_flags(0, f"127.0.0.1:{port}", tmp_path), "--max-steps", "5")
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=30)
    assert alone.returncode != 0
    assert (
        "no quorum at step 0: groups [0] asked within 3 s, at least 2 of 3 needed" in alone.stderr
    )
    assert "Traceback" not in alone.stderr

    port = free_port()
    # group 0 starts alone (1 of 3) after a 1 s start timeout
    lighthouse = fork(lighthouse_flags("127.0.0.1", port, 1, 1.0), tmp_path, "lighthouse2")
    ckpt = tmp_path / "ckpt"
    try:
        first = fork(
            group_flags(0, f"127.0.0.1:{port}", tmp_path, "--max-steps", "60")
            + ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"],
            tmp_path,
            "first",
        )
        # the other job asks only once group 0 took a step (its quorum, and so the run's
        # identity, is then group 0's); started together, either may ask first on a busy host
        deadline = time.monotonic() + 120
        while not any(ckpt.glob("group-0/step-*")):
            assert first.poll() is None, "group 0 ended before its first step"
            assert time.monotonic() < deadline, "group 0 took no step within 120 s"
            time.sleep(0.05)
        other = gradmesh(
            *group_flags(1, f"127.0.0.1:{port}", tmp_path, "--model", "mlp"), "--max-steps", "5"
        )
        first.wait(timeout=240)
        err = first.err.read_text()
        # a group that comes after the run's end (as one restarted too late would): told at
        # once, where it waited the 60 s quorum timeout and failed
        late = gradmesh(*group_flags(2, f"127.0.0.1:{port}", tmp_path), "--max-steps", "60")
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=30)
    assert late.returncode == 0, late.stderr[-2000:]
    assert (
        "replica group 2: the run finished at step 60 (groups [0]) before group 2 asked for "
        "step 0; it ends here" in late.stderr
    ), late.stderr[-2000:]
    assert json.loads((tmp_path / "group2.json").read_text())["strategy_info"]["after_the_end"]
    assert other.returncode != 0
    refused = r"group 1 at step 0 runs another job \(model mlp .*it is not admitted"
    assert re.search(refused, other.stderr), other.stderr[-2000:]
    assert first.returncode == 0, err[-2000:]
    assert json.loads((tmp_path / "group0.json").read_text())["steps"] == 60


def _run_groups(
    out: Path,
    groups: int,
    *extra: str,
    faults: dict[int, str] | None = None,
    join_s: float = 1.0,
) -> list[dict[str, Any]]:
    """`groups` replica groups of the text GPT to the end on a fresh lighthouse on the
    loopback (`faults`: GRADMESH_FAULT by group; a step then goes on with the groups alive);
    their reports."""
    port, faults = free_port(), faults or {}
    least = 1 if any(f.startswith("kill") for f in faults.values()) else groups
    lighthouse_args = lighthouse_flags("127.0.0.1", port, least, groups=groups, join_s=join_s)
    lighthouse = fork(lighthouse_args, out, "lighthouse")
    jobs: list[Run] = []
    try:
        jobs += [
            fork(
                group_flags(g, f"127.0.0.1:{port}", out, *GPT, *extra, groups=groups),
                out,
                f"group{g}",
                env={"GRADMESH_FAULT": faults[g]} if g in faults else {},
            )
            for g in range(groups)
        ]
        codes = [job.wait(timeout=240) for job in jobs]
    finally:
        for process in [*jobs, lighthouse]:  # a launcher ends its workers with it
            process.end()
    errors = [(out / f"group{g}.err").read_text()[-2000:] for g in range(groups)]
    assert codes == [0] * groups, errors
    assert ZYGOTE.left_behind() == []
    return [json.loads((out / f"group{g}.json").read_text()) for g in range(groups)]


def test_a_split_group_killed_rejoins_by_a_copy_of_each_part(tmp_path: Path) -> None:
    """Two groups of two ranks each, the model split inside every group (tensor parallel; the
    same path copies FSDP2's shards and pipeline stages, docs/fault_tolerance.md): group 1 is
    killed after step 5 and restarted by its launcher; each of
    its ranks copies its own part (rank r from rank r of group 0: the same shard), and both
    groups end with the same bits on every rank (hashed over every rank's part)."""
    got = _run_groups(
        tmp_path,
        2,
        "--workers",
        "2",
        "--tensor-parallel",
        "2",
        "--max-steps",
        "40",
        "--max-restarts",
        "1",
        # group 0 takes >= 500 ms a step: the 35 steps after the kill (17.5 s) outlast the
        # restart (3.7-6.9 s measured for one rank, docs/testing.md) 2.5 times over
        faults={0: "slow:0:500", 1: "kill:0:5"},
    )
    assert got[0]["steps"] == 40
    zero, one = (r["strategy_info"] for r in got)
    assert one["recoveries"] == 1 and zero["recoveries"] == 0
    assert one["parameters_sha256"] == zero["parameters_sha256"]  # every rank's part hashed
    assert got[0]["test_loss"] == got[1]["test_loss"]


@pytest.mark.parametrize(
    ("extra", "gone", "resumed", "recoveries", "redone", "steps"),
    [
        ((), ("0/step-00000018", "0/step-00000012", "1/step-00000018"), [6, 12], [1, 0], 6, 6),
        (
            ("--strategy", "diloco", "--sync-every", "4", "--compression", "int8"),
            ("0/step-00000018", "0/step-00000012", "1/step-00000018", "1/step-00000012"),
            [6, 6],
            [0, 0],
            12,
            12,
        ),
    ],
    ids=["every-step", "diloco-int8"],
)
def test_groups_checkpoint_and_resume_bit_equal(
    tmp_path: Path,
    extra: tuple[str, ...],
    gone: tuple[str, ...],
    resumed: list[int],
    recoveries: list[int],
    redone: int,
    steps: int,
) -> None:
    """Two groups save every 6 steps into folders of their own (group-0, group-1) to step 18;
    some newest checkpoints are taken away and the groups run again to 18, ending with the bits
    the uninterrupted run ended with. Every step averaged: group 0 resumes at step 6 and group 1
    at 12, and the first quorum has group 0 copy group 1's state (AdamW's state and the data
    position restored). DiLoCo (a round every 4 steps, int8): both resume at step 6, mid-round,
    with the anchors, the outer momentum and the int8 residuals of that step."""
    ckpt = tmp_path / "ckpt"
    flags = ("--max-steps", "18", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "6")
    first = _run_groups(tmp_path, 2, *flags, *extra)
    digest = {r["strategy_info"]["parameters_sha256"] for r in first}
    assert len(digest) == 1
    for g in range(2):
        assert sorted(p.name for p in (ckpt / f"group-{g}").glob("step-*")) == [
            f"step-{s:08d}" for s in (6, 12, 18)
        ]
    for folder in gone:
        shutil.rmtree(ckpt / f"group-{folder}")
    again = _run_groups(tmp_path, 2, *flags, *extra)
    assert [r["faults"]["resumed_from_step"] for r in again] == resumed
    # the steps trained again: from where each resumed, less what a copy skipped
    assert [r["faults"]["steps_redone"] for r in again] == [redone, redone]
    assert [r["strategy_info"]["recoveries"] for r in again] == recoveries
    assert [r["steps"] for r in again] == [steps, steps]
    assert {r["strategy_info"]["parameters_sha256"] for r in again} == digest
    for g in range(2):  # each saved step 18 again where it resumed
        assert (ckpt / f"group-{g}" / "step-00000018").is_dir()


def _until(
    what: Callable[[], bool], seconds: float, jobs: list[Any], said: list[str], why: str
) -> None:
    """Poll `what` every 50 ms (the jobs' output gathered into `said`) until it holds; fail
    naming `why` after `seconds` or when a job ended first."""
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, f"{why}: not within {seconds:.0f} s"
        assert all(p.poll() is None for job in jobs for p in job.procs), f"{why}: a job ended"
        time.sleep(0.05)


@pytest.mark.skipif(namespaces.missing_capability() is not None, reason="no network namespaces")
def test_a_link_unplugged_mid_copy_fails_the_copy_in_a_line_and_the_other_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lighthouse on emulated host 0, group 0 on host 1 training alone, group 1 started on
    host 2 later, so it joins by copying group 0's state over 10 Mbit/s links. Once group 0's
    link carries the copy, group 1's link is unplugged (`ip link set eth0 down`): the copy fails
    on the 3 s collective timeout, group 1 says so in one line naming the source and the step,
    group 0 goes on alone, and with the link back group 1 asks again and rejoins (or, had
    group 0 finished first, is told the run is over; the links are then made 1 Gbit/s so that
    the steps left are quick); nothing half-copied is loaded: groups
    that both took the last step hold the same bits."""
    said: list[str] = []

    def heard(text: str) -> bool:
        said.append(capsys.readouterr().err)
        return text in "".join(said)

    steps = 240
    flags = [*GPT, "--max-steps", str(steps), "--compression", "int8", "--quorum-timeout-s", "3"]
    with EmulatedCluster(hosts=3, bandwidth="10mbit") as cluster:
        address = f"{cluster.address(0)}:29600"
        lighthouse = cluster.start_on(
            0, ["gradmesh", *lighthouse_flags(cluster.address(0), 29600, 1, 1.0, groups=2)]
        )
        slow = {"GRADMESH_FAULT": "slow:0:80"}  # >= 80 ms a step: the run outlasts the fault
        first = cluster.start_on(
            1, ["gradmesh", *group_flags(0, address, tmp_path, *flags, groups=2)], env=slow
        )
        jobs = [lighthouse, first]
        # group 0 trains alone once its requests to the lighthouse add up (~1 kB a step)
        _until(lambda: cluster.bytes_sent(1) > 50_000, 120, jobs, said, "group 0 training")
        second = cluster.start_on(
            2, ["gradmesh", *group_flags(1, address, tmp_path, *flags, groups=2)]
        )
        jobs.append(second)
        # the copy: group 0's link sends > 50 kB in 0.1 s (alone it sends ~25 kB a second)
        sent = [cluster.bytes_sent(1)]

        def copying() -> bool:
            sent.append(cluster.bytes_sent(1))
            time.sleep(0.05)
            return sent[-1] - sent[-2] > 50_000

        _until(copying, 120, jobs, said, "the copy to group 1")
        cluster.set_link(2, up=False)
        unplugged = time.monotonic()
        failed = "replica group 1: the copy of group 0's state at step "
        _until(lambda: heard(failed), 60, jobs, said, "the failed copy's line")
        seconds = time.monotonic() - unplugged
        time.sleep(1)  # group 0 trains alone meanwhile
        for host in (1, 2):  # the link back, faster: the steps left take seconds, not minutes
            cluster.set_bandwidth(host, "1gbit")
        cluster.set_link(2, up=True)
        codes = [job.wait(timeout=240) for job in (first, second)]
        lighthouse.procs[0].terminate()  # SIGTERM: a background shell leaves SIGINT ignored
        lighthouse.wait(timeout=30)
    heard("")
    err = "".join(said)
    assert codes == [0, 0], err[-3000:]
    line = re.search(
        failed + r"(\d+) failed \(.*\); nothing was loaded, the step is taken again", err
    )
    assert line is not None, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    step = int(line.group(1))
    assert seconds < 3 + 10, (seconds, err[-3000:])  # the collective timeout, and the line
    got = [json.loads((tmp_path / f"group{g}.json").read_text()) for g in range(2)]
    zero, one = (r["strategy_info"] for r in got)
    # group 0 went on to the end, alone after the failed copy
    assert got[0]["steps"] == steps, (got[0], err[-3000:])
    alone = [c for c in zero["quorum_changes"] if c["members"] == [0] and c["step"] >= step]
    assert alone, (zero["quorum_changes"], err[-3000:])
    if one["after_the_end"]:  # group 0 finished before the link came back
        assert one["recoveries"] == 0
    else:  # the copy taken again over the link plugged back in: the same bits on both (a
        # busy machine can drop group 1 once more after it rejoined, and it copies again:
        # 2 recoveries, beside two CPU hogs and another test worker; this line failed in both
        # of two such runs)
        assert one["recoveries"] >= 1 and got[1]["steps"] < steps - step, (one, got[1], err[-3000:])
        assert one["parameters_sha256"] == zero["parameters_sha256"], (one, zero, err[-3000:])
    print(
        f"the copy at step {step} failed {seconds:.1f} s after the unplug; group 1 "
        + ("came after the end" if one["after_the_end"] else "rejoined")
        + f", group 0's longest step {zero['step_s_longest']:.2f} s",
        file=sys.stderr,
    )


def test_a_script_s_replica_groups_go_on_without_a_killed_one_and_take_it_back(
    tmp_path: Path,
) -> None:
    """examples/replica_groups.py (`gradmesh.ReplicaGroup` around a user's model, optimizer
    and loop) as two groups under `gradmesh run --max-restarts 1`: group 1's process is killed
    after step 20; group 0 goes on alone, group 1 is restarted, copies the state from it, and
    both end with the same bits and the digits learnt."""
    port = free_port()
    lighthouse = fork(lighthouse_flags("127.0.0.1", port, 1, groups=2), tmp_path, "lighthouse")
    script = [sys.executable, str(ROOT / "examples" / "replica_groups.py")]
    jobs: list[Run] = []
    try:
        jobs += [
            fork(
                ["run", "-np", "1", "--max-restarts", "1"]
                + ["--", *script, "--group", str(g), "--groups", "2", "--steps", "400"]
                # the 380 steps after the kill (17.1 s) outlast the restart 2.5 times over
                + ["--step-ms", "45"]
                + ["--lighthouse", f"127.0.0.1:{port}", "--json", str(tmp_path / f"{g}.json")]
                + (["--kill-after", "20"] if g == 1 else []),
                tmp_path,
                str(g),
            )
            for g in range(2)
        ]
        codes = [job.wait(timeout=240) for job in jobs]
    finally:
        for job in jobs:
            job.end()
        lighthouse.kill()
        lighthouse.wait(timeout=30)
    errors = [(tmp_path / f"{g}.err").read_text()[-2000:] for g in range(2)]
    assert codes == [0, 0], errors
    zero, one = (json.loads((tmp_path / f"{g}.json").read_text()) for g in range(2))
    assert zero["steps"] == one["steps"] == 400
    alone = [c for c in zero["quorum_changes"] if c["members"] == [0]]
    assert alone and alone[0]["step"] <= 21  # group 0 went on without it
    assert one["recoveries"] == 1 and one["quorum_changes"][0]["step"] > 20
    assert one["parameters_sha256"] == zero["parameters_sha256"]
    assert zero["accuracy"] > 0.9


def test_diloco_across_groups_rounds_every_h_steps_and_takes_a_killed_group_back(
    tmp_path: Path,
) -> None:
    """DiLoCo across two groups (`--strategy diloco --sync-every 10 --compression int8`): the
    groups meet only every 10 steps, sending an int8 outer gradient; group 1 is killed mid-round
    (after step 25); the next round has a new quorum (group 0 alone, or with group 1 restarted
    by its launcher within the join timeout), and group 1 joins at a round by copying the state
    after that round's outer step; both end with the same bits after the last round."""
    got = _run_groups(
        tmp_path,
        2,
        *("--strategy", "diloco", "--sync-every", "10", "--compression", "int8"),
        *("--max-steps", "120", "--max-restarts", "1"),
        # group 0 takes >= 180 ms a step: the 95 steps after the kill (17.1 s) outlast the
        # restart 2.5 times over; a round waits up to 5 s for the slower group (the other is
        # faster by 1.8 s a round)
        faults={0: "slow:0:180", 1: "kill:0:25"},
        join_s=5.0,
    )
    zero, one = (r["strategy_info"] for r in got)
    assert got[0]["steps"] == 120 and zero["outer_rounds"] == 12  # a round every 10 steps
    # the round after the kill had a new quorum: group 0 alone, or with group 1 restarted
    # within the 5 s join timeout (a new process: a new process group)
    assert [c["step"] for c in zero["quorum_changes"]][:2] == [0, 30]
    rejoined = one["quorum_changes"][0]
    assert one["recoveries"] == 1 and rejoined["step"] % 10 == 0 and rejoined["step"] >= 30
    assert one["parameters_sha256"] == zero["parameters_sha256"]
    # bytes across groups: an int8 outer gradient every 10 steps, against the float32 gradient
    # a step of per-step averaging (measured: 1/40)
    layout = got[0]["per_rank"]["layout"]
    assert layout["compression_sent_bytes_per_step"][0] < layout["param_bytes"][0] / 30
