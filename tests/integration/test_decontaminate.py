"""Decontamination end to end: documents sharing 13-grams with eval sets are removed."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from pipelines import decontaminate
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.decontaminate import DecontaminateConfig, build_index, find_matches
from pipelines.stage import StageError, config_from_mapping
from pipelines.text import words

HELLASWAG = (
    "A man is standing on a ladder next to a house. He scrapes old paint off the wooden"
    " siding with a long metal tool, then wipes the boards clean with a rag."
)
PIQA = "How do you keep fresh basil from wilting in the kitchen?"  # 11 words: used whole
TOO_SHORT = "Where is Paris?"  # 3 words: skipped
FILLER = (
    "Our town library runs a reading club every Thursday evening, and new members are always"
    " welcome to bring a book they enjoyed and talk about it over tea."
)


def _doc(doc_id: str, text: str, source: str = "web") -> dict:
    return {"id": doc_id, "text": text, "source": source, "metadata": {}}


DOCS = [
    _doc("clean", FILLER),
    # The eval sentence copied with other case and punctuation still matches.
    _doc("copy-hellaswag", FILLER + " " + HELLASWAG.upper().replace(",", ";")),
    _doc("copy-piqa", f"Tip of the day: {PIQA} Put it in a glass of water."),
    _doc("both", f"{HELLASWAG}\n\n{PIQA}"),
    # Twelve consecutive words of the eval sentence: below the 13-gram threshold.
    _doc("near-miss", "Look: " + " ".join(HELLASWAG.split()[:12]) + " and then goes home."),
    _doc("paris", "Where is Paris? It is in France, on the river Seine."),
    _doc("empty", ""),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("decon")
    (root / "eval").mkdir()
    with gzip.open(root / "eval" / "hellaswag.jsonl.gz", "wt") as handle:
        handle.write(json.dumps(_doc("hs-1", HELLASWAG, "hellaswag")) + "\n")
        handle.write("{not json\n")
    (root / "piqa.jsonl").write_text(
        json.dumps(_doc("piqa-1", PIQA, "piqa"))
        + "\n"
        + json.dumps(_doc("piqa-2", TOO_SHORT, "piqa"))
        + "\n"
    )
    lines = [json.dumps(d) for d in DOCS] + ["nope", json.dumps({"id": "x", "text": 3})]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _argv(files: Path, out: Path) -> list[str]:
    return [
        "--input",
        str(files / "in.jsonl"),
        "--output",
        str(out),
        "--eval_set",
        str(files / "eval" / "*.jsonl.gz"),
        "--eval_set",
        str(files / "piqa.jsonl"),
    ]


@pytest.fixture(scope="module")
def run(files):
    out = files / "out"
    manifest = decontaminate.main(_argv(files, out)).manifest
    kept = {d["id"]: d for d in read_documents(str(out))}
    letters = list(read_dead_letters(str(out)))
    return out, manifest, kept, letters


def test_accounting(run):
    _, manifest, kept, letters = run
    assert manifest.records_in == len(DOCS) + 2
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert Counter(x["reason"] for x in letters) == manifest.dropped
    assert manifest.dropped["invalid_json"] == 1
    assert manifest.dropped["non_string_text"] == 1
    assert len(kept) == manifest.records_out


def test_copies_of_eval_text_are_removed_with_their_sets(run):
    _, manifest, _, letters = run
    contaminated = {x["origin"]: x for x in letters if x["reason"] == "contamination"}
    assert set(contaminated) == {"copy-hellaswag", "copy-piqa", "both"}
    assert contaminated["copy-hellaswag"]["eval_sets"] == ["hellaswag"]
    assert contaminated["copy-piqa"]["eval_sets"] == ["piqa"]
    assert contaminated["both"]["eval_sets"] == ["hellaswag", "piqa"]
    example = contaminated["copy-hellaswag"]["example_ngram"]
    assert len(example.split()) == 13 and example in " ".join(words(HELLASWAG))
    assert contaminated["copy-piqa"]["example_ngram"] == PIQA.lower().rstrip("?")
    assert manifest.dropped["contamination"] == 3
    assert manifest.extra["contamination_by_eval_set"] == {"hellaswag": 2, "piqa": 2}


def test_near_misses_and_short_eval_texts_do_not_match(run):
    _, _, kept, _ = run
    assert {"clean", "near-miss", "paris", "empty"} <= set(kept)


def test_manifest_describes_the_eval_sets(run):
    _, manifest, _, _ = run
    sets = manifest.extra["eval_sets"]
    assert sets["piqa"] == {"texts": 2, "short_texts_skipped": 1, "ngrams": 1}
    assert sets["hellaswag"]["texts"] == 1 and sets["hellaswag"]["ngrams"] > 10
    assert manifest.extra["eval_records_invalid"] == 1
    assert len(manifest.config["eval_sets"]) == 2
    assert manifest.config["ngram"] == 13


def test_second_run_is_byte_identical(run, files, tmp_path, digest):
    out = run[0]
    again = tmp_path / "again"
    decontaminate.main(_argv(files, again))
    assert digest(out) == digest(again)


def test_min_overlap_needs_that_many_shared_ngrams():
    index = build_index([_doc("hs", HELLASWAG, "hellaswag")], DecontaminateConfig())
    one_gram_copy = " ".join(HELLASWAG.split()[:13])  # exactly one shared 13-gram
    assert find_matches(one_gram_copy, index, 1)[0] == {"hellaswag": 1}
    assert find_matches(one_gram_copy, index, 2)[0] == {}
    assert find_matches(HELLASWAG, index, 2)[0]["hellaswag"] > 2


def test_missing_eval_set_is_a_clear_error(files, tmp_path, capsys):
    base = ["--input", str(files / "in.jsonl"), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        decontaminate.main(base)
    assert exit_info.value.code == 2
    assert "--eval_set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decontaminate.main([*base, "--eval_set", str(tmp_path / "absent-*.jsonl")])
    assert "matches no files" in capsys.readouterr().err


def test_a_missing_eval_set_is_refused_before_the_last_output_is_cleared(files, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "last-run.txt").write_text("kept")
    base = ["--input", str(files / "in.jsonl"), "--output", str(out)]
    absent = str(tmp_path / "absent-*.jsonl")
    for extra, named in [([], "--eval_set"), (["--eval_set", absent], repr(absent))]:
        with pytest.raises(SystemExit) as exit_info:
            decontaminate.main([*base, *extra])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "eval_sets" in err and named in err
        assert (out / "last-run.txt").read_text() == "kept"


@pytest.mark.parametrize(
    ("values", "named"),
    [({"ngrams": 13}, "ngrams"), ({"ngram": 0}, "ngram"), ({"eval_sets": "x.jsonl"}, "eval_sets")],
)
def test_bad_config_names_the_field(values, named):
    with pytest.raises(StageError, match=named):
        config_from_mapping(DecontaminateConfig, values)


def test_eval_texts_are_normalized_as_ingest_normalizes_the_corpus():
    """An eval text in NFD with a zero-width space still matches the same sentence after
    ingest (NFC, zero-width characters removed)."""
    import unicodedata

    from pipelines.text import normalize_text

    sentence = (
        "At the café near the old crème brûlée stall the naïve chef served a soufflé, a"
        " crêpe and a purée to every fiancé who came"
    )
    eval_text = unicodedata.normalize("NFD", sentence).replace("brûlée", "brû\u200blée")
    assert eval_text != sentence
    index = build_index([_doc("e", eval_text, "lambada")], DecontaminateConfig())
    matched, example = find_matches(normalize_text(eval_text), index, 1)
    assert matched == {"lambada": len(words(sentence)) - 12}
    assert example is not None and "café" in example


def test_an_output_overlapping_an_eval_set_is_refused(files, tmp_path, capsys):
    evals = tmp_path / "o" / "eval"
    evals.mkdir(parents=True)
    (evals / "x.jsonl").write_text(json.dumps(_doc("e", HELLASWAG, "hellaswag")) + "\n")
    argv = ["--input", str(files / "in.jsonl"), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        decontaminate.main([*argv, "--eval_set", str(evals / "*.jsonl")])
    assert exit_info.value.code == 2
    assert "overlaps" in capsys.readouterr().err
    assert (evals / "x.jsonl").exists()
