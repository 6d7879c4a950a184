"""The parameter-server message decoder under fuzzing, its stream transport, and a real server fed
garbage."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradmesh.compression.registry import make
from gradmesh.sync.parameter_server.client import Client, shard_ranges
from gradmesh.sync.parameter_server.optimizers import AdaRevision
from gradmesh.sync.parameter_server.protocol import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    WIRE_VERSION,
    Kind,
    WireError,
    decode,
    encode,
)
from gradmesh.sync.parameter_server.server import Server
from gradmesh.sync.parameter_server.serving import ServerConfig
from gradmesh.sync.parameter_server.transport import Peer, connect, endpoint_of, listen

TOKEN = bytes(range(16))
BOUND = 4096


def header(**fields: int | bytes) -> bytes:
    values = {
        "magic": MAGIC,
        "version": WIRE_VERSION,
        "kind": int(Kind.PUSH),
        "dtype": 1,
        "ndim": 1,
        "worker": 0,
        "token": TOKEN,
        "clock": 1,
        "seen": 0,
        "staleness": 0,
        "d0": 4,
        "d1": 0,
        "d2": 0,
        "d3": 0,
        "offset": 0,
        "nbytes": 16,
        "codec": 0,
        "c0": 0,
        "c1": 0,
        "c2": 0,
    }
    values.update(fields)
    return HEADER.pack(*values.values())


def test_an_honest_message_round_trips() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    msg = decode(encode(Kind.PUSH, TOKEN, 3, clock=7, tensor=t), TOKEN, BOUND)
    assert msg.kind is Kind.PUSH and msg.worker == 3 and msg.clock == 7
    assert msg.payload is not None and torch.equal(msg.payload, t)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([header()[:-1], bytes(16)], "header is"),
        ([header(magic=b"XXXX"), bytes(16)], "magic"),
        ([header(token=bytes(16)), bytes(16)], "token"),
        ([header(kind=99), bytes(16)], "kind"),
        ([header(dtype=42), bytes(16)], "dtype"),
        ([header(nbytes=8), bytes(16)], "length field"),
        ([header(d0=5), bytes(16)], "is not 16 bytes"),
        ([header(ndim=7), bytes(16)], "shape"),
        ([header(), bytes(16), b"x"], "frames"),
        ([header(d0=BOUND, nbytes=BOUND * 4), bytes(BOUND * 4)], "over the bound"),
    ],
)
def test_bad_messages_are_named(frames: list[bytes], why: str) -> None:
    with pytest.raises(WireError, match=why):
        decode(frames, TOKEN, BOUND)


fields = st.fixed_dictionaries(
    {
        "magic": st.sampled_from([MAGIC, b"GMPX", b"\0\0\0\0"]),
        "version": st.sampled_from([WIRE_VERSION, 0, 255]),
        "kind": st.integers(0, 255),
        "dtype": st.integers(0, 255),
        "ndim": st.integers(0, 255),
        "worker": st.integers(0, 65535),
        "token": st.sampled_from([TOKEN, bytes(16), TOKEN[::-1]]),
        "d0": st.sampled_from([0, 1, 4, 2**31, 2**32 - 1]),
        "d1": st.sampled_from([0, 1, 3, 2**32 - 1]),
        "nbytes": st.sampled_from([0, 4, 16, 2**40, 2**64 - 1]),
        "codec": st.integers(0, 255),
        "c0": st.sampled_from([0, 1, 4, 64, 2**32 - 1]),
        "c1": st.sampled_from([0, 1, 512, 2**32 - 1]),
        "c2": st.sampled_from([0, 1, 2**32 - 1]),
    }
)


@settings(max_examples=3_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=fields, body=st.binary(max_size=64), cut=st.integers(0, HEADER_BYTES + 8))
def test_the_decoder_survives_3000_fuzzed_messages(
    fields: dict[str, int | bytes], body: bytes, cut: int
) -> None:
    raw = header(**fields)
    frames = [raw[:cut] if cut < HEADER_BYTES else raw + bytes(cut - HEADER_BYTES), body]
    tracemalloc.start()
    try:
        msg = decode(frames, TOKEN, BOUND)
    except WireError:
        msg = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 * 1024  # never allocates what a length or shape field claims
    if msg is not None and msg.payload is not None:
        assert msg.payload.numel() * msg.payload.element_size() == len(body)


def test_a_server_fed_garbage_keeps_serving_an_honest_worker() -> None:
    numel = 64
    topk_out_of_range = struct.pack("<fi", 1.0, numel)
    server = Server(ServerConfig.of(0, 1, numel, timeout_s=20), TOKEN, "127.0.0.1")
    stats: list[dict[str, object]] = []
    thread = threading.Thread(target=lambda: stats.append(server.serve()), daemon=True)
    thread.start()
    cut_off = [  # the stream ends inside a header
        [b"short"],
        [struct.pack("<Q", 2**63)],
    ]
    bad_header = [  # the stream cannot be followed past these: the server closes it
        [header(token=bytes(16)), bytes(16)],
        [header(nbytes=2**60), bytes(16)],
        [header(d0=1 << 20, nbytes=4 << 20), bytes(4 << 20)],  # over the bound: never read
    ]
    bad_body = [  # whole messages that fail: dropped, the connection kept
        [header(dtype=9), bytes(16)],
        [header(worker=7), bytes(16)],  # no such worker
        [header(d0=4), bytes(16)],  # the wrong shard size
        # compressed pushes (uint8 payload) that do not parse: unknown codec, a context that does
        # not fit the shard, a top-k index outside it, a codec on a byte payload
        [header(dtype=4, d0=16, codec=77, c0=numel), bytes(16)],
        [header(dtype=4, d0=16, codec=3, c0=numel + 1, c1=512), bytes(16)],
        [header(dtype=4, d0=8, codec=4, c0=numel, c1=1), topk_out_of_range],
        [header(dtype=0, ndim=0, d0=0, codec=1, nbytes=4), bytes(4)],
    ]
    garbage = cut_off + bad_header + bad_body
    for frames in garbage * 2:  # each on a connection of its own
        with connect(server.endpoint, 10) as attacker, contextlib.suppress(ConnectionError):
            attacker.sendall(b"".join(frames))  # the server may close it before all is sent
    with connect(server.endpoint, 10) as attacker:  # one after the other on one connection
        attacker.sendall(b"".join(part for frames in bad_body for part in frames))
    honest = Client([server.endpoint], TOKEN, 0, numel, timeout_s=10)
    values = torch.arange(numel, dtype=torch.float32)
    honest.init(values)
    out = torch.zeros(numel)
    honest.pull(out)
    assert torch.equal(out, values)
    # an honest compressed push is decoded and applied: top-k keeps the 2 largest of 64
    honest.compressor = make("topk", ratio=2 / numel, error_feedback="off")
    honest.states = [honest.compressor.new_state(numel)]
    grad = torch.zeros(numel)
    grad[[5, 9]] = torch.tensor([1.0, -2.0])
    honest.pull(out, push=grad)
    expected = values.clone()
    expected[[5, 9]] -= 0.05 * torch.tensor([1.0, -2.0])  # the server's SGD, lr 0.05
    assert torch.allclose(out, expected)
    honest.finish({"samples": 1, "wall_s": 1.0})
    honest.close_servers()
    honest.close()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert stats[0]["dropped_messages"] == len(garbage) * 2 + len(bad_body)
    assert stats[0]["decompressed_pushes"] == 1


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with listen("127.0.0.1") as listener:
        theirs = connect(endpoint_of(listener), 10)
        listener.setblocking(True)
        ours, _ = listener.accept()
    return ours, theirs


def test_a_header_over_the_bound_is_refused_before_its_body_is_read() -> None:
    ours, theirs = tcp_pair()
    with ours, theirs:
        peer = Peer(ours, TOKEN, BOUND)
        theirs.sendall(header(d0=BOUND, nbytes=BOUND * 4) + bytes(BOUND * 4))
        with pytest.raises(WireError, match="over the bound"):
            while peer.receive() is None:
                pass
        assert len(peer.buffer) == 0  # nothing was allocated for it


def test_a_reply_the_kernel_cannot_take_at_once_is_sent_as_it_was() -> None:
    """`volatile`: what is not written yet is copied before the sender's memory changes."""
    ours, theirs = tcp_pair()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        shard = torch.arange(1 << 18, dtype=torch.float32)  # 1 MB: more than the kernel takes
        peer = Peer(ours, TOKEN, 0)
        peer.send(encode(Kind.PARAMS, TOKEN, 0, tensor=shard), volatile=True)
        assert peer.out  # some of it waits
        sent = shard.clone()
        shard += 1  # the next update
        reader = Peer(theirs, TOKEN, 4 << 20)
        frames = None
        while frames is None:
            peer.flush()
            frames = reader.receive()
        assert peer.flush()
        got = decode(frames, TOKEN, 4 << 20).payload
        assert got is not None and torch.equal(got, sent)
        peer.send(encode(Kind.PARAMS, TOKEN, 0, tensor=shard), volatile=True)
        spill = peer.spill
        frames = None
        while frames is None:
            peer.flush()
            frames = reader.receive()
        assert peer.spill is spill  # the copy's buffer is reused, not reallocated
        got = decode(frames, TOKEN, 4 << 20).payload
        assert got is not None and torch.equal(got, sent + 1)


def test_shards_are_balanced_and_cover_everything() -> None:
    ranges = shard_ranges(10, 3)
    assert ranges == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(Exception, match="cannot be split"):
        shard_ranges(2, 3)


def test_adarevision_without_delay_is_adagrad() -> None:
    x = torch.nn.Parameter(torch.ones(5))
    ada = AdaRevision(x, lr=0.5)
    ref = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.Adagrad([ref], lr=0.5, initial_accumulator_value=0.1, eps=0.0)
    for step in range(4):
        g = torch.linspace(-1, 1, 5) * (step + 1)
        ada.on_read(0)
        ada.apply(g, 0, 1.0)
        ref.grad = g.clone()
        opt.step()
    torch.testing.assert_close(x.detach(), ref.detach())


def test_adarevision_revises_a_delayed_gradient() -> None:
    x = torch.nn.Parameter(torch.zeros(1))
    ada = AdaRevision(x, lr=1.0)
    ada.on_read(0)  # worker 0 reads, then worker 1's gradient lands first
    ada.on_read(1)
    ada.apply(torch.ones(1), 1, 1.0)
    before = x.detach().clone()
    ada.apply(torch.ones(1), 0, 1.0)  # it never saw worker 1's gradient: z' grows by 1 + 2*1*1
    eta_old, eta = 1 / 1.1**0.5, 1 / 4.1**0.5
    # its own step at the new rate, and the backlog's earlier step revised down to that rate
    assert float(before - x.detach()) == pytest.approx(eta - (eta_old - eta), rel=1e-5)
    assert float(before - x.detach()) < 1 / 2.1**0.5 / 10  # AdaGrad would step 20x further
