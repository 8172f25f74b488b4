"""`elasticpp data prepare`: text files in, a flat token file and its JSON sidecar out."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from elasticpp.cli.data import choose_dtype
from elasticpp.cli.main import main
from elasticpp.errors import ConfigError
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import check_data, open_corpus

DOCS = {
    "a.txt": "the quick brown fox jumps over the lazy dog\n" * 30,
    "b.txt": "héllo wörld, naïve café; über straße\n" * 20,
    "c.txt": "def f(x):\n    return x * 2  # doubled\n" * 25,
}


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A small byte-level BPE tokenizer trained on local text, and the text files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS.values(), trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    files = []
    for name, text in DOCS.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        files.append(tmp_path / name)
    return path, files


def prepare(*args: str | Path) -> int:
    return main(["data", "prepare", *map(str, args)])


def load_tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def test_prepare_writes_the_tokenizers_ids_and_a_sidecar(
    tmp_path: Path, corpus: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    tok_path, files = corpus
    out = tmp_path / "corpus.bin"
    # No flag: the tokenizer's one end-of-text special token separates the documents.
    assert prepare("--tokenizer", tok_path, "--out", out, *files) == 0
    tok = load_tokenizer(tok_path)
    eos = tok.token_to_id("<|eos|>")
    expected: list[int] = []
    for f in files:
        expected += tok.encode(f.read_text(encoding="utf-8"), add_special_tokens=False).ids
        expected.append(eos)
    got = np.fromfile(out, dtype="<u2")
    assert got.tolist() == expected
    assert tok.decode(got[: got.tolist().index(eos)].tolist()) == DOCS["a.txt"]
    sidecar = json.loads((tmp_path / "corpus.bin.json").read_text())
    assert sidecar == {
        "format_version": 2,
        "dtype": "uint16",
        "byte_order": "little",
        "tokens": len(expected),
        "documents": 3,
        "vocab_size": tok.get_vocab_size(),
        "eod_token": "<|eos|>",
        "eod_id": eos,
        "tokenizer_sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(),
    }
    printed = capsys.readouterr()
    assert f"--data {out} (its sidecar" in printed.out and "--data-dtype" not in printed.out
    assert f"'<|eos|>' (id {eos}) after each" in printed.out and not printed.err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # What it wrote trains: windows of the model's sequence length over these ids.
    job = TrainConfig(data=str(out), data_dtype="uint16", data_shuffle=False)
    inputs, _ = open_corpus(job, 16, 320).batch(0, 1)
    assert inputs[0].tolist() == expected[:16]


def test_prepare_with_no_eod_concatenates_and_uint32_on_request(
    tmp_path: Path, corpus: tuple[Path, list[Path]]
) -> None:
    tok_path, files = corpus
    out = tmp_path / "c32.bin"
    args = ("--tokenizer", tok_path, "--out", out, "--dtype", "uint32", "--no-eod")
    assert prepare(*args, *files[:2]) == 0
    tok = load_tokenizer(tok_path)
    expected = [
        i for f in files[:2] for i in tok.encode(f.read_text(), add_special_tokens=False).ids
    ]
    assert np.fromfile(out, dtype="<u4").tolist() == expected
    sidecar = json.loads((tmp_path / "c32.bin.json").read_text())
    assert (sidecar["dtype"], sidecar["eod_id"], sidecar["documents"]) == ("uint32", None, 2)


def test_training_reads_a_prepared_file_as_its_sidecar_says_and_refuses_another_dtype(
    tmp_path: Path, corpus: tuple[Path, list[Path]]
) -> None:
    tok_path, files = corpus
    out = tmp_path / "c32.bin"
    assert prepare("--tokenizer", tok_path, "--out", out, "--dtype", "uint32", *files) == 0
    ids = np.fromfile(out, dtype="<u4").tolist()
    # Read as uint16, the low and high halves of every id are ids that all fit the vocabulary:
    # only the sidecar can tell this is wrong.
    assert max(np.fromfile(out, dtype="<u2")) < 320
    wrong = TrainConfig(data=str(out), data_dtype="uint16", data_shuffle=False)
    with pytest.raises(ConfigError, match=r"holds uint32 ids .*c32\.bin\.json.*'uint16'"):
        check_data(wrong, 16, 320)
    job = TrainConfig(data=str(out), data_shuffle=False)  # no dtype: the sidecar's
    check_data(job, 16, 320)
    inputs, _ = open_corpus(job, 16, 320).batch(0, 1)
    assert inputs[0].tolist() == ids[:16]


def test_refusals_exit_2_with_one_line_and_overwrite_nothing(
    tmp_path: Path, corpus: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    tok_path, files = corpus
    out = tmp_path / "corpus.bin"
    assert prepare("--tokenizer", tok_path, "--out", out, *files) == 0
    before = out.read_bytes(), (tmp_path / "corpus.bin.json").read_bytes()
    capsys.readouterr()
    bad_tok = tmp_path / "bad.json"
    bad_tok.write_text("{not json")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (["--tokenizer", tok_path, "--out", out, *files], "--force"),
        (["--tokenizer", tok_path, "--out", out, "--force", tmp_path / "nope.txt"], "nope.txt"),
        (["--tokenizer", tmp_path / "none.json", "--out", out, "--force", *files], "none.json"),
        (["--tokenizer", bad_tok, "--out", out, "--force", *files], "bad.json"),
        (["--tokenizer", tok_path, "--out", out, "--force", latin1], "not UTF-8"),
        (["--tokenizer", tok_path, "--out", out, "--force", "--eos-token", "<x>", *files], "<x>"),
        (["--tokenizer", tok_path, "--out", out, "--force", "--eod-id", "320", *files], "320"),
        (["--tokenizer", tok_path, "--out", tmp_path / "c.npy", *files], "must end in .bin"),
    ]
    for args, needle in cases:
        assert prepare(*args) == 2, needle
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (needle, err)
    assert (out.read_bytes(), (tmp_path / "corpus.bin.json").read_bytes()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not (tmp_path / "c.npy").exists()
    # --force replaces both files.
    assert prepare("--tokenizer", tok_path, "--out", out, "--force", files[0]) == 0
    assert json.loads((tmp_path / "corpus.bin.json").read_text())["documents"] == 1


def plain_tokenizer(path: Path, special: list[str]) -> Path:
    """A word-level tokenizer with these special tokens, saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *special, "the", "quick", "brown", "fox"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(special)
    path.parent.mkdir(exist_ok=True)
    tok.save(str(path))
    return path


def test_the_end_of_document_token_comes_from_the_tokenizer_or_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox")
    out = tmp_path / "c.bin"

    def run(tok: Path, *flags: str) -> tuple[list[int], dict[str, object]]:
        assert prepare("--tokenizer", tok, "--out", out, "--force", *flags, doc, doc) == 0
        return np.fromfile(out, dtype="<u2").tolist(), json.loads(Path(f"{out}.json").read_text())

    # Llama 3's names: <|end_of_text|> ends a text; <|eot_id|> ends a chat turn, not a document.
    llama = plain_tokenizer(
        tmp_path / "llama" / "tokenizer.json", ["<|end_of_text|>", "<|eot_id|>"]
    )
    ids, sidecar = run(llama)
    assert ids == [3, 4, 5, 6, 1] * 2
    assert (sidecar["eod_id"], sidecar["eod_token"]) == (1, "<|end_of_text|>")
    ids, sidecar = run(llama, "--eod-id", "2")
    assert ids == [3, 4, 5, 6, 2] * 2 and sidecar["eod_token"] == "<|eot_id|>"
    # A tokenizer_config.json beside the tokenizer names it, as transformers saves it.
    (tmp_path / "llama" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|eot_id|>"}})
    )
    assert run(llama)[1]["eod_id"] == 2
    capsys.readouterr()
    # None to be found: no separator, said on stderr and recorded; --no-eod says it is meant.
    plain = plain_tokenizer(tmp_path / "plain.json", [])
    ids, sidecar = run(plain)
    assert ids == [1, 2, 3, 4] * 2 and sidecar["eod_id"] is None
    assert "has no end-of-text token" in capsys.readouterr().err
    run(plain, "--no-eod")
    assert not capsys.readouterr().err
    # Two candidates are refused, not guessed between.
    both = plain_tokenizer(tmp_path / "both.json", ["</s>", "<|endoftext|>"])
    assert prepare("--tokenizer", both, "--out", out, "--force", doc) == 2
    assert "several special tokens may end a text (<|endoftext|>, </s>)" in capsys.readouterr().err


def test_shards_prepared_with_different_end_of_document_ids_are_not_one_dataset(
    tmp_path: Path,
) -> None:
    tok = plain_tokenizer(tmp_path / "tok.json", ["</s>", "<pad>"])
    (tmp_path / "shards").mkdir()
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox " * 10)
    for name, flags in (("a", ()), ("b", ("--eod-id", "2"))):
        out = tmp_path / "shards" / f"{name}.bin"
        assert prepare("--tokenizer", tok, "--out", out, *flags, doc, doc) == 0
    with pytest.raises(ConfigError, match=r"a\.bin' \(eod_id 1\) and .*b\.bin' \(eod_id 2\)"):
        check_data(TrainConfig(data=str(tmp_path / "shards")), 8, 256)


def test_uint16_is_refused_for_a_vocabulary_that_does_not_fit() -> None:
    assert choose_dtype(65536, None) == "uint16"
    assert choose_dtype(65537, None) == "uint32"
    assert choose_dtype(300, "uint32") == "uint32"
    with pytest.raises(ConfigError, match="65537"):
        choose_dtype(65537, "uint16")


def test_without_tokenizers_installed_the_message_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("text")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails
    args = ("--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "x.bin")
    assert prepare(*args, tmp_path / "a.txt") == 2
    err = capsys.readouterr().err
    assert "elasticpp[data]" in err and "tokenizers" in err
    assert not (tmp_path / "x.bin").exists()


def test_prepare_prints_what_it_wrote_as_json_the_sidecar_and_the_paths(
    tmp_path: Path, corpus: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    tok_path, files = corpus
    out = tmp_path / "corpus.bin"
    assert prepare("--tokenizer", tok_path, "--out", out, "-o", "json", *files) == 0
    printed = json.loads(capsys.readouterr().out)
    sidecar = json.loads((tmp_path / "corpus.bin.json").read_text())
    assert printed.pop("out") == str(out) and printed.pop("sidecar") == f"{out}.json"
    assert printed.pop("message").startswith(f"wrote {sidecar['tokens']} tokens")
    assert printed == sidecar
