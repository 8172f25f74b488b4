"""Training data: token-file windows (exact addressing, shuffle), raw bytes, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from elasticpp.errors import ConfigError
from elasticpp.train.config import TrainConfig
from elasticpp.train.data import samples as data_mod
from elasticpp.train.data.samples import (
    Corpus,
    TokenCorpus,
    check_data,
    epoch_permutation,
    open_corpus,
    stable_int,
)

SEQ = 8
VOCAB = 256


def write_tokens(tmp_path: Path, fmt: str, ids: np.ndarray) -> TrainConfig:
    """`ids` as a token file of format `fmt` ("uint16.bin", "uint32.npy", ...); its config."""
    dtype, suffix = fmt.split(".")
    path = tmp_path / f"tokens.{suffix}"
    if suffix == "npy":
        np.save(path, ids.astype(dtype))
        return TrainConfig(data=str(path))
    ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
    return TrainConfig(data=str(path), data_dtype=dtype)


def with_(job: TrainConfig, **changes: object) -> TrainConfig:
    return TrainConfig.from_dict({**job.to_dict(), **changes})


def window(ids: np.ndarray, w: int) -> list[int]:
    return ids[w * SEQ : w * SEQ + SEQ + 1].tolist()


FORMATS = ["uint16.bin", "uint32.bin", "uint16.npy", "uint32.npy", "int32.npy", "int64.npy"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_unshuffled_sample_i_is_window_i_mod_w_of_the_file(tmp_path: Path, fmt: str) -> None:
    ids = np.arange(50)  # W = (50 - 1) // 8 = 6 windows; tokens 49.. are never read
    job = with_(write_tokens(tmp_path, fmt, ids), data_shuffle=False)
    corpus = open_corpus(job, SEQ, VOCAB)
    assert isinstance(corpus, TokenCorpus) and corpus.windows == 6
    inputs, targets = corpus.batch(4, 4)  # samples 4, 5, 6, 7: windows 4, 5, then 0, 1
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (4, SEQ)
    rows = [window(ids, w) for w in (4, 5, 0, 1)]
    assert inputs.tolist() == [r[:-1] for r in rows]
    assert targets.tolist() == [r[1:] for r in rows]
    assert corpus.window(6 * 1000 + 5).tolist() == window(ids, 5)  # wraps in every epoch


def test_shuffled_epochs_use_every_window_exactly_once_in_a_seeded_order(tmp_path: Path) -> None:
    ids = np.arange(20 * SEQ + 1) % VOCAB  # W = 20
    job = with_(write_tokens(tmp_path, "uint16.bin", ids), seed=7)
    a, b = open_corpus(job, SEQ, VOCAB), open_corpus(job, SEQ, VOCAB)
    assert isinstance(a, TokenCorpus) and isinstance(b, TokenCorpus)
    order = [a.window_index(i) for i in range(60)]
    for e in range(3):
        epoch = order[20 * e : 20 * (e + 1)]
        assert sorted(epoch) == list(range(20))
        # The documented permutation, exactly.
        rng = np.random.Generator(np.random.PCG64(stable_int("epoch", 7, e)))
        assert epoch == rng.permutation(20).tolist()
    assert order[:20] != order[20:40]
    assert [b.window_index(i) for i in reversed(range(60))] == order[::-1]  # any call order
    # A batch that straddles an epoch boundary reads the same rows as sample by sample.
    inputs, _ = a.batch(17, 6)
    assert inputs.tolist() == [window(ids, w)[:-1] for w in order[17:23]]
    other = open_corpus(with_(job, seed=8), SEQ, VOCAB)
    assert isinstance(other, TokenCorpus)
    assert [other.window_index(i) for i in range(20)] != order[:20]


def test_the_epoch_permutation_is_pinned() -> None:
    # Every machine must draw this order; a numpy upgrade that changes it changes the data.
    assert epoch_permutation(7, 0, 10).tolist() == [3, 0, 2, 1, 9, 5, 4, 6, 8, 7]
    assert epoch_permutation(7, 1, 10).tolist() == [7, 5, 3, 2, 6, 1, 4, 9, 0, 8]


def test_consecutive_batches_concatenate_to_one_batch(tmp_path: Path) -> None:
    job = write_tokens(tmp_path, "uint32.bin", np.arange(300) % VOCAB)
    corpus = open_corpus(job, SEQ, VOCAB)
    whole, _ = corpus.batch(30, 10)
    parts = [corpus.batch(30 + k, n)[0] for k, n in ((0, 3), (3, 4), (7, 3))]
    assert torch.equal(torch.cat(parts), whole)


def test_ids_outside_the_vocabulary_are_refused_when_the_file_is_opened(tmp_path: Path) -> None:
    ids = np.arange(100) % 200
    ids[5] = 300
    job = write_tokens(tmp_path, "uint16.bin", ids)
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"tokens\.bin.*token id 300 at position 5.*256"):
            check(job, SEQ, VOCAB)
    negative = write_tokens(tmp_path, "int32.npy", np.concatenate([np.arange(40), [-1]]))
    with pytest.raises(ConfigError, match="token id -1 at position 40"):
        open_corpus(negative, SEQ, VOCAB)


def test_an_id_the_open_time_sample_misses_is_refused_when_its_window_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shrink the sample: ends [0, 4) and [197, 201), chunks of 2 at 22, 44, 67, 89, 111, ...
    monkeypatch.setattr(data_mod, "_CHECK_END_TOKENS", 4)
    monkeypatch.setattr(data_mod, "_CHECK_CHUNK_TOKENS", 2)
    ids = np.arange(201) % 100
    ids[100] = 999  # in window 12 (tokens 96..104)
    job = with_(write_tokens(tmp_path, "uint16.npy", ids), data_shuffle=False)
    corpus = open_corpus(job, SEQ, VOCAB)
    corpus.batch(0, 12)  # windows 0..11 are clean
    with pytest.raises(ConfigError, match=r"tokens\.npy.*token id 999 at position 100.*256"):
        corpus.batch(12, 1)


def test_a_file_without_one_whole_window_is_refused_with_its_numbers(tmp_path: Path) -> None:
    job = write_tokens(tmp_path, "uint16.bin", np.arange(SEQ))
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"has 8 tokens.*seq_len \+ 1 = 9"):
            check(job, SEQ, VOCAB)
    assert open_corpus(write_tokens(tmp_path, "uint16.bin", np.arange(SEQ + 1)), SEQ, VOCAB)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="has 0 tokens"):
        open_corpus(TrainConfig(data=str(empty), data_dtype="uint32"), SEQ, VOCAB)


@pytest.mark.parametrize(
    ("array", "needle"),
    [
        (np.arange(40, dtype=np.float32), "float32"),
        (np.arange(40, dtype=np.uint8), "uint8"),
        (np.arange(40, dtype=np.int32).reshape(4, 10), "2-D"),
    ],
)
def test_a_npy_file_of_another_dtype_or_shape_is_refused(
    tmp_path: Path, array: np.ndarray, needle: str
) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ConfigError, match=needle):
        open_corpus(TrainConfig(data=str(path)), SEQ, VOCAB)


def test_a_npy_file_with_a_different_data_dtype_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.arange(40, dtype=np.uint32))
    with pytest.raises(ConfigError, match="holds uint32 ids but data_dtype is 'uint16'"):
        open_corpus(TrainConfig(data=str(path), data_dtype="uint16"), SEQ, VOCAB)
    assert open_corpus(TrainConfig(data=str(path), data_dtype="uint32"), SEQ, VOCAB)


def test_a_bin_file_of_a_partial_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(41))
    with pytest.raises(ConfigError, match="41 bytes, not a whole number of uint16"):
        open_corpus(TrainConfig(data=str(path), data_dtype="uint16"), SEQ, VOCAB)


def test_a_bin_file_without_sidecar_or_data_dtype_is_refused_naming_both_ways_out(
    tmp_path: Path,
) -> None:
    # Token ids whose sidecar was lost: read as bytes they would train on garbage.
    path = tmp_path / "t.bin"
    (np.arange(300) % VOCAB).astype("<u2").tofile(path)
    jobs = [
        TrainConfig(data=str(path)),
        TrainConfig(data=str(path), data_shuffle=False),
        TrainConfig(data=[str(path)]),  # type: ignore[arg-type]
    ]
    for job in jobs:
        for check in (open_corpus, check_data):
            with pytest.raises(ConfigError) as err:
                check(job, SEQ, VOCAB)
            message = str(err.value)
            assert repr(str(path)) in message and "t.bin.json" in message
            assert "elasticpp data prepare" in message and "--data-dtype" in message
    # Either way out reads it as token ids.
    assert type(open_corpus(TrainConfig(data=str(path), data_dtype="uint16"), SEQ, VOCAB)) is (
        TokenCorpus
    )
    write_sidecar(path, "uint16", 300, VOCAB)
    assert type(open_corpus(TrainConfig(data=str(path)), SEQ, VOCAB)) is TokenCorpus


def test_a_raw_corpus_over_the_cap_is_refused_naming_corpus_max_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"A" * 600)
    (tmp_path / "b.txt").write_bytes(b"B" * 500)
    job = TrainConfig(data=str(tmp_path), corpus_max_bytes=1000)
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"is 1100 bytes.*corpus_max_bytes 1000"):
            check(job, SEQ, VOCAB)
    assert open_corpus(with_(job, corpus_max_bytes=1100), SEQ, VOCAB)


def test_the_built_in_corpus_is_still_capped_not_refused() -> None:
    corpus = open_corpus(TrainConfig(corpus_max_bytes=1 << 16), SEQ, VOCAB)
    assert type(corpus) is Corpus
    check_data(TrainConfig(corpus_max_bytes=1 << 16), SEQ, VOCAB)


def test_raw_bytes_need_a_vocabulary_of_256(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 100)
    for data in (str(path), None):
        for check in (open_corpus, check_data):
            with pytest.raises(ConfigError, match=r"vocab_size of at least 256 .*got 100"):
                check(TrainConfig(data=data), SEQ, 100)
    # A token file is fine with a small vocabulary when its ids fit.
    job = write_tokens(tmp_path, "uint16.bin", np.arange(40) % 100)
    assert open_corpus(job, SEQ, 100)


def test_data_dtype_with_a_directory_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "shards.bin"
    folder.mkdir()
    (folder / "a").write_bytes(b"x" * 100)
    job = TrainConfig(data=str(folder), data_dtype="uint16")
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match="directory"):
            check(job, SEQ, VOCAB)
    with pytest.raises(ConfigError, match="no such file"):
        open_corpus(TrainConfig(data=str(tmp_path / "x.npy")), SEQ, VOCAB)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"data": "t.bin", "data_dtype": "int8"}, "data_dtype must be one of uint16, uint32"),
        ({"data": "t.bin", "data_dtype": 16}, "data_dtype"),
        ({"data_dtype": "uint16"}, "data_dtype 'uint16' applies to a token file"),
        ({"data": "corpus.txt", "data_dtype": "uint16"}, r"ending in \.bin or \.npy"),
        ({"data": "t.npy", "data_shuffle": "no"}, "data_shuffle must be true or false"),
        ({"data": "t.txt", "data_shuffle": False}, "data_shuffle false applies to token files"),
        ({"data": []}, "data is an empty list"),
        ({"data": ["/d/a.bin", "/d/b.txt"]}, "a list names token files.*'/d/b.txt'"),
        ({"data": ["/d/a.bin", "b.bin"]}, "takes absolute paths, got 'b.bin'"),
        ({"data_shuffle": False}, "data_shuffle false applies to token files"),
    ],
)
def test_train_config_refuses_bad_data_settings_naming_the_field(
    fields: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict(fields)


def test_train_config_keeps_a_list_of_shards_as_a_tuple_through_json() -> None:
    cfg = TrainConfig(data=["/d/a.bin", "/d/b.npy"], data_shuffle=False)  # type: ignore[arg-type]
    assert cfg.data == ("/d/a.bin", "/d/b.npy")
    assert cfg.to_dict()["data"] == ["/d/a.bin", "/d/b.npy"]
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    # A directory may hold shards (decided when it is opened), so the config lets these pass.
    assert TrainConfig(data="shards", data_dtype="uint16", data_shuffle=False)


def write_sidecar(
    path: Path, dtype: str, count: int, vocab: int, extra: dict[str, object] | None = None
) -> None:
    """The sidecar `elasticpp data prepare` writes beside `path` (format 1 fields)."""
    fields = {
        "format_version": 1,
        "dtype": dtype,
        "byte_order": "little",
        "tokens": count,
        "documents": 1,
        "vocab_size": vocab,
        "eos_token": None,
        "eos_id": None,
        "tokenizer_sha256": "0" * 64,
        **(extra or {}),
    }
    Path(f"{path}.json").write_text(json.dumps(fields))


LLAMA3_VOCAB = 128256


def test_a_sidecar_decides_the_dtype_and_a_data_dtype_contradicting_it_is_refused(
    tmp_path: Path,
) -> None:
    # A Llama-3 corpus: ids up to 128255 need uint32. Read as uint16, every id is below 65536,
    # so the vocabulary check alone lets the garbage through.
    ids = np.random.default_rng(0).integers(0, LLAMA3_VOCAB, size=200)
    path = tmp_path / "llama3.bin"
    ids.astype("<u4").tofile(path)
    write_sidecar(path, "uint32", len(ids), LLAMA3_VOCAB)
    wrong = TrainConfig(data=str(path), data_dtype="uint16", data_shuffle=False)
    for check in (open_corpus, check_data):
        with pytest.raises(
            ConfigError, match=r"holds uint32 ids .*sidecar.* data_dtype is 'uint16'"
        ):
            check(wrong, SEQ, LLAMA3_VOCAB)
    # Without data_dtype (or with the right one) the sidecar's dtype reads the right ids.
    for dtype in (None, "uint32"):
        job = TrainConfig(data=str(path), data_dtype=dtype, data_shuffle=False)
        check_data(job, SEQ, LLAMA3_VOCAB)
        corpus = open_corpus(job, SEQ, LLAMA3_VOCAB)
        assert isinstance(corpus, TokenCorpus)
        inputs, targets = corpus.batch(1, 1)
        assert inputs[0].tolist() == window(ids, 1)[:-1]
        assert targets[0].tolist() == window(ids, 1)[1:]


def test_a_sidecar_that_does_not_describe_its_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(100).astype("<u2").tofile(path)
    job = TrainConfig(data=str(path))
    cases = [
        ({"tokens": 90}, "holds 100 uint16 tokens but its sidecar says 90"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of uint16, uint32"),
        ({"format_version": 9}, "format_version 9"),
        ({"byte_order": "big"}, "byte_order 'big'"),
        ({"vocab_size": "many"}, "vocab_size must be an integer"),
    ]
    for extra, needle in cases:
        write_sidecar(path, "uint16", 100, VOCAB, extra)
        for check in (open_corpus, check_data):
            with pytest.raises(ConfigError, match=needle):
                check(job, SEQ, VOCAB)
    Path(f"{path}.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        check_data(job, SEQ, VOCAB)


def test_a_sidecar_vocabulary_larger_than_the_models_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(100).astype("<u2").tofile(path)  # every id fits 256 ...
    write_sidecar(path, "uint16", 100, 50257)  # ... but the tokenizer had 50257 tokens
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"vocabulary of 50257 tokens.*vocab_size 256"):
            check(TrainConfig(data=str(path)), SEQ, VOCAB)


def write_shards(
    folder: Path, ids: np.ndarray, sizes: list[int], dtype: str = "uint16"
) -> list[Path]:
    """`ids` split into .bin shards of `sizes` tokens under `folder`, each with a sidecar."""
    assert sum(sizes) == len(ids)
    folder.mkdir()
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = folder / f"part-{k:02d}.bin"
        ids[start : start + size].astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
        write_sidecar(path, dtype, size, VOCAB)
        paths.append(path)
        start += size
    return paths


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_file_and_uneven_shards_give_the_same_sample_for_every_index(
    tmp_path: Path, shuffle: bool
) -> None:
    ids = np.random.default_rng(1).integers(0, VOCAB, size=203)  # W = 25 windows
    one = write_tokens(tmp_path, "uint16.bin", ids)
    # A shard shorter than a window: some windows straddle two shard boundaries.
    paths = write_shards(tmp_path / "shards", ids, [50, 7, 146])
    jobs = [
        with_(one, data_shuffle=shuffle),
        TrainConfig(data=str(tmp_path / "shards"), data_shuffle=shuffle),
        TrainConfig(data=tuple(str(p) for p in reversed(paths)), data_shuffle=shuffle),
    ]
    corpora = [open_corpus(job, SEQ, VOCAB) for job in jobs]
    for job in jobs:
        check_data(job, SEQ, VOCAB)
    assert {c.windows for c in corpora if isinstance(c, TokenCorpus)} == {25}
    samples = 3 * 25 + 4  # three epochs and a bit
    want = corpora[0].batch(0, samples)
    for corpus in corpora[1:]:
        got = corpus.batch(0, samples)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # Any split into micro-batches (any rank's share) reads the same samples.
        for first, count in ((0, 3), (6, 5), (24, 2), (49, 7)):
            part = corpus.batch(first, count)
            assert torch.equal(part[0], want[0][first : first + count])
    if not shuffle:  # window 6 is ids 48..56: shard 0's last 2, shard 1's 7
        assert corpora[1].window(6).tolist() == ids[48:57].tolist()


def test_shards_that_cannot_be_one_dataset_are_refused_naming_both(tmp_path: Path) -> None:
    ids = np.arange(100) % VOCAB
    a, b = write_shards(tmp_path / "s", ids, [60, 40])
    job = TrainConfig(data=str(tmp_path / "s"))
    cases = [
        (
            {"dtype": "uint32"},
            r"'.*part-00\.bin' \(dtype 'uint16'\) and '.*part-01\.bin' \(dtype 'uint32'\)",
        ),
        ({"vocab_size": 200}, "vocab_size 256.*vocab_size 200"),
        ({"tokenizer_sha256": "1" * 64}, "must agree on tokenizer_sha256"),
        ({"eos_id": 3}, "must agree on eod_id"),
    ]
    for extra, needle in cases:
        if extra.get("dtype") == "uint32":
            np.arange(40).astype("<u4").tofile(b)
        else:
            np.arange(40).astype("<u2").tofile(b)
        write_sidecar(b, "uint16", 40, VOCAB, extra)
        for check in (open_corpus, check_data):
            with pytest.raises(ConfigError, match=needle):
                check(job, SEQ, VOCAB)
    write_sidecar(b, "uint16", 40, VOCAB)
    assert open_corpus(job, SEQ, VOCAB)
    # A shard named twice, and a data_dtype that one shard's sidecar contradicts.
    with pytest.raises(ConfigError, match=r"names token shard .* twice"):
        open_corpus(TrainConfig(data=(str(a), str(a))), SEQ, VOCAB)
    Path(f"{b}.json").unlink()
    np.arange(40).astype("<u4").tofile(b)
    with pytest.raises(ConfigError, match=r"part-00\.bin' holds uint16 ids.*'uint32'"):
        open_corpus(TrainConfig(data=str(tmp_path / "s"), data_dtype="uint32"), SEQ, VOCAB)
    with pytest.raises(ConfigError, match=r"part-01\.bin' has no sidecar"):
        open_corpus(job, SEQ, VOCAB)


def test_a_directory_of_shards_holds_nothing_else_but_hidden_files(tmp_path: Path) -> None:
    ids = np.arange(100) % VOCAB
    write_shards(tmp_path / "s", ids, [60, 40])
    (tmp_path / "s" / ".part-02.bin.123.tmp").write_bytes(b"half-written")
    job = TrainConfig(data=str(tmp_path / "s"), data_shuffle=False)
    assert open_corpus(job, SEQ, VOCAB).window(0).tolist() == ids[: SEQ + 1].tolist()
    (tmp_path / "s" / "README.txt").write_text("notes")
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"token shards .* and other files \(README\.txt\)"):
            check(job, SEQ, VOCAB)


def test_an_id_outside_the_vocabulary_is_named_by_its_shard_and_position(tmp_path: Path) -> None:
    ids = np.arange(100) % 200
    ids[70] = 300  # position 10 of the second shard
    write_shards(tmp_path / "s", ids, [60, 40])
    for check in (open_corpus, check_data):
        with pytest.raises(ConfigError, match=r"part-01\.bin': token id 300 at position 10 "):
            check(TrainConfig(data=str(tmp_path / "s")), SEQ, VOCAB)


def test_an_id_found_only_when_read_is_named_by_its_shard_and_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_mod, "_CHECK_END_TOKENS", 2)
    monkeypatch.setattr(data_mod, "_CHECK_CHUNK_TOKENS", 1)
    ids = np.arange(201) % 100
    ids[150] = 999  # position 50 of the second shard, in window 18 (tokens 144..152)
    write_shards(tmp_path / "s", ids, [100, 101])
    corpus = open_corpus(TrainConfig(data=str(tmp_path / "s"), data_shuffle=False), SEQ, VOCAB)
    corpus.batch(0, 18)
    with pytest.raises(ConfigError, match=r"part-01\.bin': token id 999 at position 50 "):
        corpus.batch(18, 1)
