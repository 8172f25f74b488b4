"""Pure parts of the training engine: schedules, config, data windows, init, assignment."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from elasticpp.errors import ConfigError
from elasticpp.plan import ClusterSpec, Layout, ModelSpec, build_plan, load_device_spec
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import Corpus, load_corpus
from elasticpp.train.engine.schedule import (
    BACKWARD,
    FORWARD,
    Op,
    Phase,
    max_in_flight,
    p2p_phases,
    schedule_ops,
)
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model
from elasticpp.train.worker.main import Assignment, StopControl
from elasticpp.train.worker.snapshots import is_snapshot_writer

MODEL = ModelSpec("t", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_1f1b_keeps_at_most_p_minus_s_in_flight_and_gpipe_keeps_m(p: int, m: int) -> None:
    for s in range(p):
        ops = schedule_ops("1f1b", p, s, m)
        assert max_in_flight(ops) == min(p - s, m)
        assert max_in_flight(schedule_ops("gpipe", p, s, m)) == m
        for kind in ("1f1b", "gpipe"):
            ops = schedule_ops(kind, p, s, m)
            fwd = [o.microbatch for o in ops if o.kind == FORWARD]
            bwd = [o.microbatch for o in ops if o.kind == BACKWARD]
            assert fwd == list(range(m)) and bwd == list(range(m))
            done: set[int] = set()
            for o in ops:  # a backward only after its forward
                if o.kind == FORWARD:
                    done.add(o.microbatch)
                else:
                    assert o.microbatch in done


def test_1f1b_warms_up_p_minus_s_minus_1_forwards() -> None:
    ops = schedule_ops("1f1b", 4, 1, 6)
    assert [o.kind for o in ops[:4]] == [FORWARD, FORWARD, FORWARD, BACKWARD]
    with pytest.raises(ValueError):
        schedule_ops("zigzag", 2, 0, 2)


def _counterpart(op: Op, stage: int) -> tuple[int, Op]:
    """Where the receive of `op` on `stage` is sent from: the same op one stage earlier (a
    forward's input) or later (a backward's output gradient)."""
    return (stage - 1 if op.kind == FORWARD else stage + 1), op


def _runs_to_the_end(plans: list[list[Phase]]) -> bool:
    """Simulate NCCL's semantics: a rank waits on its whole phase; a send or receive completes
    only once the peer has posted the phase holding its counterpart."""
    where: list[dict[tuple[str, str, int], int]] = []
    for phases in plans:
        index = {}
        for k, ph in enumerate(phases):
            if ph.send is not None:
                index[("send", ph.send.kind, ph.send.microbatch)] = k
            if ph.recv is not None:
                index[("recv", ph.recv.kind, ph.recv.microbatch)] = k
        where.append(index)
    pos = [0] * len(plans)

    def reached(stage: int, what: tuple[str, str, int]) -> bool:
        return pos[stage] >= where[stage][what]

    moved = True
    while moved:
        moved = False
        for s, phases in enumerate(plans):
            if pos[s] == len(phases):
                continue
            ph = phases[pos[s]]
            ok = True
            if ph.recv is not None:
                peer, op = _counterpart(ph.recv, s)
                ok &= reached(peer, ("send", op.kind, op.microbatch))
            if ph.send is not None:
                peer = s + 1 if ph.send.kind == FORWARD else s - 1
                ok &= reached(peer, ("recv", ph.send.kind, ph.send.microbatch))
            if ok:
                pos[s] += 1
                moved = True
    return all(p == len(ph) for p, ph in zip(pos, plans, strict=True))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_batched_p2p_phases_never_deadlock_and_send_every_result_once(
    kind: str, p: int, m: int
) -> None:
    plans = [p2p_phases(kind, p, s, m) for s in range(p)]
    assert _runs_to_the_end(plans)
    for s, phases in enumerate(plans):
        assert [ph.run for ph in phases if ph.run is not None] == schedule_ops(kind, p, s, m)
        sent = [ph.send for ph in phases if ph.send is not None]
        assert len(sent) == (m if s < p - 1 else 0) + (m if s > 0 else 0)
        for before, ph in itertools.pairwise(phases):  # a send is the op run just before it
            assert ph.send is None or ph.send == before.run
        assert all(ph.recv is None or ph.recv == ph.run for ph in phases)


def test_the_simulation_sees_the_deadlock_of_blocking_sends_in_1f1b() -> None:
    # A send waited on alone right after its op (no batching with the next receive): in the
    # steady phase both neighbours send first and wait for a receive that never comes.
    unbatched = []
    for s in range(2):
        phases = []
        for ph in p2p_phases("1f1b", 2, s, 4):
            if ph.send is not None:
                phases.append(Phase(ph.send, None, None))
            phases.append(Phase(None, ph.recv, ph.run))
        unbatched.append(phases)
    assert not _runs_to_the_end(unbatched)


def test_train_config_validates_fields_and_round_trips() -> None:
    cfg = TrainConfig(seed=3, steps=7, dropout=0.1, schedule="gpipe", betas=(0.8, 0.9))
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for bad in (
        {"steps": 0},
        {"lr": -1.0},
        {"dropout": 1.0},
        {"schedule": "zigzag"},
        {"precision": "fp16"},
        {"betas": (0.9,)},
        {"min_lr": 1.0, "lr": 0.1},
    ):
        with pytest.raises(ConfigError):
            TrainConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown field"):
        TrainConfig.from_dict({"stepz": 3})


def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr() -> None:
    cfg = TrainConfig(steps=10, lr=1.0, min_lr=0.1, warmup_steps=2)
    assert cfg.lr_at(0) == pytest.approx(0.5)
    assert cfg.lr_at(1) == pytest.approx(1.0)
    assert cfg.lr_at(2) == pytest.approx(1.0)
    assert cfg.lr_at(10) == pytest.approx(0.1)
    lrs = [cfg.lr_at(k) for k in range(2, 11)]
    assert lrs == sorted(lrs, reverse=True)


def test_a_sample_is_the_same_window_wherever_it_is_computed(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 40
    a, b = Corpus(blob, 16, seed=1), Corpus(blob, 16, seed=1)
    x1, y1 = a.batch(100, 4)
    x2, _ = b.batch(102, 2)
    assert torch.equal(x1[2:], x2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(Corpus(blob, 16, seed=2).batch(100, 4)[0], x1)
    (tmp_path / "b.txt").write_bytes(b"B" * 50)
    (tmp_path / "a.txt").write_bytes(b"A" * 50)
    assert load_corpus(str(tmp_path), 100) == b"A" * 50 + b"B" * 50
    with pytest.raises(ConfigError, match="corpus_max_bytes 70"):
        load_corpus(str(tmp_path), 70)  # refused, never truncated
    with pytest.raises(ConfigError):
        load_corpus(str(tmp_path / "missing"), 10)


def test_default_corpus_is_stdlib_python_source() -> None:
    blob = load_corpus(None, 1 << 16)
    assert len(blob) == 1 << 16
    assert b"def " in blob


def test_tp_slices_of_the_initialisation_concatenate_to_the_whole() -> None:
    model = build_model(MODEL)
    for name in ("embed", "block.0002", "head"):
        unit = model.unit(name)
        whole = init_unit(unit, 5, 0, 1)
        parts = [init_unit(unit, 5, r, 4) for r in range(4)]
        for spec in unit.params:
            if spec.shard_dim is None:
                assert all(torch.equal(p[spec.name], whole[spec.name]) for p in parts)
            else:
                joined = torch.cat([p[spec.name] for p in parts], spec.shard_dim)
                assert torch.equal(joined, whole[spec.name]), spec.name
    assert not torch.equal(
        init_unit(model.unit("block.0000"), 5, 0, 1)["attn.q.weight"],
        init_unit(model.unit("block.0001"), 5, 0, 1)["attn.q.weight"],
    )


def _plan(layout: str, nodes: int = 1) -> object:
    L = Layout.parse(layout)
    cluster = ClusterSpec.uniform(nodes, L.world_size // nodes, load_device_spec("cpu"))
    return build_plan(MODEL, cluster, L, global_batch=8, micro_batch=2)


def test_assignment_round_trips_and_refuses_bad_fields() -> None:
    plan = _plan("pp=2,dp=2")
    a = Assignment(plan, 3, "127.0.0.1", 1234, "gen0", TrainConfig())  # type: ignore[arg-type]
    assert Assignment.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    skip = Assignment(plan, 3, "127.0.0.1", 1234, "gen0", TrainConfig(), snapshot_when_busy="skip")  # type: ignore[arg-type]
    assert Assignment.from_dict(json.loads(json.dumps(skip.to_dict()))) == skip
    data = a.to_dict()
    for key, value in (
        ("rank", 4),
        ("format_version", 2),
        ("backend", "mpi"),
        ("start_step", 3),
        ("store_port", 0),
        ("snapshot_when_busy", "drop"),
    ):
        with pytest.raises(ConfigError):
            Assignment.from_dict({**data, key: value})
    with pytest.raises(ConfigError):
        Assignment.from_dict({k: v for k, v in data.items() if k != "plan"})


def test_only_the_lowest_dp_twin_on_a_node_writes_snapshots() -> None:
    one_node = _plan("pp=2,dp=2")
    writers = [r for r in range(4) if is_snapshot_writer(one_node, r)]  # type: ignore[arg-type]
    assert writers == [0, 1]
    two_nodes = _plan("pp=1,dp=2", nodes=2)
    assert [is_snapshot_writer(two_nodes, r) for r in range(2)] == [True, True]  # type: ignore[arg-type]


def test_stop_control_keeps_the_smallest_request() -> None:
    c = StopControl()
    assert c.value(99) == 99
    c.request(7)
    c.request(9)
    assert c.value(99) == 7


class _Work:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait(self) -> bool:
        self.log.append(self.name)
        return True


@pytest.mark.parametrize("coalesced", [False, True])
def test_an_exchange_waits_on_its_receive_and_leaves_its_send_for_after_the_op(
    monkeypatch: pytest.MonkeyPatch, coalesced: bool
) -> None:
    from elasticpp.train.engine import p2p

    waited: list[str] = []

    def batch(ops: list[object]) -> list[_Work]:
        if coalesced:  # NCCL: one work for the whole batch
            return [_Work("batch", waited)]
        return [_Work(f"op{i}", waited) for i in range(len(ops))]

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(p2p.dist, "P2POp", lambda op, t, peer: (op, t, peer))
    sent, inbox = torch.ones(2), torch.empty(2)

    sending = p2p.exchange((sent, 1), (inbox, 1))
    if coalesced:
        assert waited == ["batch"] and sending.tensor is None  # waited on whole before the op
    else:
        assert waited == ["op1"]  # the receive only; the send is still in flight
        assert sending.tensor is sent
        sending.finish()
        assert waited == ["op1", "op0"] and sending.tensor is None and sending.works == []

    waited.clear()
    alone = p2p.exchange((sent, 1), None)  # a send with no receive: finished after the op
    assert waited == [] and alone.tensor is sent
    alone.finish()
    assert waited == ["batch" if coalesced else "op0"]

    waited.clear()
    p2p.exchange(None, (inbox, 1)).finish()  # a receive alone is waited on at once
    assert waited == ["batch" if coalesced else "op0"]
    with pytest.raises(RuntimeError, match="neighbour this stage does not have"):
        p2p.exchange((sent, None), None)
