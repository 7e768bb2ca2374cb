"""Quality rules on their own: scores, thresholds, per-source config, and multi-megabyte documents."""

from __future__ import annotations

import random
import re

import pytest

from pipelines import quality
from pipelines.quality import (
    RULES,
    QualityConfig,
    QualityThresholds,
    apply_thresholds,
    filter_document,
    score_text,
)
from pipelines.stage import StageError, config_from_mapping
from pipelines.text import line_spans
from tests.support.long_documents import ENGLISH, long_document


def failures(text: str, **overrides: object) -> list[str]:
    return apply_thresholds(score_text(text), QualityThresholds(**overrides))


def test_normal_english_paragraph_passes():
    assert len(ENGLISH.split()) >= 100
    assert failures(ENGLISH) == []


def test_lorem_ipsum_fails():
    text = ENGLISH + "\n\nLorem ipsum dolor sit amet, consectetur adipiscing elit."
    assert failures(text) == ["max_lorem_ipsum"]


def test_short_text_fails_min_words_first():
    failed = failures("Hello there.")
    assert failed[0] == "min_words"


def test_word_salad_without_stop_words_fails():
    salad = " ".join(f"alpha{i} beta{i} gamma{i}." for i in range(40))
    assert "min_stop_words" in failures(salad)


def test_bullet_lists_fail_bullet_rule():
    text = "\n".join(f"- item number {i} with some words" for i in range(30))
    failed = failures(text)
    assert failed[0] == "max_bullet_line_fraction"
    assert "min_terminal_punctuation_line_fraction" in failed


def test_ellipsis_heavy_text_fails():
    text = ENGLISH + "\n" + "\n".join(f"the story goes on {i}..." for i in range(30))
    failed = failures(text)
    assert "max_ellipsis_line_fraction" in failed
    assert "max_ellipsis_word_ratio" in failed


def test_hash_tags_fail_symbol_ratio():
    text = ENGLISH + " " + " ".join(f"#tag{i}" for i in range(40))
    assert "max_hash_word_ratio" in failures(text)


def test_cookie_and_javascript_boilerplate_fails():
    lines = [
        "This site uses cookies to improve your experience.",
        "Please enable JavaScript in your browser to view this page.",
        "Read our privacy policy and cookie policy for details.",
        "The museum opens at nine on weekdays and at ten on weekends.",
    ]
    text = "\n".join(lines * 5) + "\n\n" + ENGLISH
    assert "max_boilerplate_line_fraction" in failures(text, max_duplicate_line_fraction=None)


def test_repetition_rules_catch_repeated_content():
    sentence = "Buy the best cheap watches and get free shipping on all of the orders today."
    text = " ".join([sentence] * 30)
    failed = failures(text)
    assert "max_top_3gram_char_fraction" in failed
    assert "max_duplicate_10gram_char_fraction" in failed
    # The same sentence repeated on its own lines also trips the duplicate-line rules.
    failed_lines = failures("\n".join([sentence] * 30))
    assert {"max_duplicate_line_fraction", "max_duplicate_line_char_fraction"} <= set(failed_lines)


def test_duplicate_paragraphs_are_scored():
    scores = score_text(
        "\n\n".join(["First paragraph here.", "Second one.", "First paragraph here."])
    )
    assert scores["duplicate_paragraph_fraction"] == pytest.approx(1 / 3, abs=1e-6)
    assert 0 < scores["duplicate_paragraph_char_fraction"] < 1


def test_non_alphabetic_text_fails_alpha_rule():
    text = " ".join(f"{i} {i * 7} ++ {i}.{i}" for i in range(60)) + " the and of to"
    assert "min_alpha_word_fraction" in failures(text)


def test_scores_are_raw_numbers_for_every_rule():
    scores = score_text(ENGLISH)
    assert {rule.score for rule in RULES} <= set(scores)
    assert scores["word_count"] == len(ENGLISH.split())
    assert 3 < scores["mean_word_length"] < 10
    assert scores["stop_words"] >= 10


def test_empty_text_scores_without_error():
    scores = score_text("")
    assert scores["word_count"] == 0
    assert apply_thresholds(scores, QualityThresholds())[0] == "min_words"


def test_disabled_and_switched_off_rules():
    scores = score_text("x")
    assert apply_thresholds(scores, QualityThresholds(enabled=False)) == []
    assert "min_words" not in apply_thresholds(scores, QualityThresholds(min_words=None))


def test_reapplying_thresholds_to_stored_scores():
    scores = score_text(ENGLISH)  # what metadata["quality"] holds
    assert apply_thresholds(scores, QualityThresholds()) == []
    assert apply_thresholds(scores, QualityThresholds(min_words=500)) == ["min_words"]


def test_per_source_overrides_change_only_named_fields():
    config = config_from_mapping(
        QualityConfig,
        {
            "thresholds": {"min_words": 40},
            "sources": {"python-stdlib": {"enabled": False}, "fortunes": {"min_words": 3}},
        },
    )
    resolved = config.resolved()
    assert config.thresholds.min_words == 40
    assert resolved["fortunes"].min_words == 3
    assert resolved["fortunes"].max_words == QualityThresholds().max_words
    assert resolved["python-stdlib"].enabled is False


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"min_wrds": 3}, "min_wrds"),
        ({"thresholds": {"max_wordz": 3}}, "max_wordz"),
        ({"sources": {"fortunes": {"min_wordz": 3}}}, "min_wordz"),
        ({"sources": {"fortunes": {"min_words": "many"}}}, "min_words"),
        ({"sources": {"fortunes": 3}}, "fortunes"),
        # NaN compares false: the rule would silently never fire
        ({"thresholds": {"min_words": float("nan")}}, "min_words must be a finite number"),
        ({"sources": {"fortunes": {"max_words": float("nan")}}}, "max_words must be a finite"),
        ({"thresholds": {"min_words": 40.5}}, "min_words must be a whole number"),
    ],
)
def test_bad_config_names_the_field(values, named):
    with pytest.raises(StageError, match=named):
        config_from_mapping(QualityConfig, values)


def test_a_record_that_breaks_scoring_becomes_a_processing_error():
    out = list(
        filter_document(
            {"id": "x", "text": None, "source": "web", "metadata": {}}, QualityThresholds(), {}
        )
    )
    assert len(out) == 1
    assert out[0].value["reason"] == "processing_error"
    assert out[0].value["origin"] == "x"


@pytest.mark.parametrize(
    ("shape", "megabytes", "first_reason"),
    [("prose", 10, "max_words"), ("one_long_token", 20, "min_words")],
)
def test_a_multi_megabyte_document_is_scored_and_refused(shape, megabytes, first_reason):
    # How the time grows with the length is measured by tests/bench/bench_quality_scaling.py;
    # a quadratic scorer would take hours here and hit pytest's timeout.
    scores = score_text(long_document(shape, megabytes * 1024 * 1024))
    assert apply_thresholds(scores, QualityThresholds())[:1] == [first_reason]


@pytest.mark.parametrize("k", [1.0, 1.2, 2.0])
def test_the_scaling_benchmark_fits_the_exponent_of_made_up_times(k):
    """``make bench``'s check of how scoring grows with the length (no timing here)."""
    from tests.bench.bench_quality_scaling import MAX_EXPONENT, fit_exponent

    sizes = [0.5, 2, 8, 32]
    assert fit_exponent(sizes, [0.03 * s**k for s in sizes]) == pytest.approx(k)
    assert (fit_exponent(sizes, [s**k for s in sizes]) >= MAX_EXPONENT) == (k == 2.0)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_exponent([4, 4], [1.0, 1.1])


def test_line_rules_look_at_single_characters():
    # _line_scores checks a line's first and last character against these sets.
    assert all(len(c) == 1 for c in (*quality.BULLETS, *quality.TERMINAL_PUNCTUATION))


@pytest.mark.parametrize(
    "text",
    [
        "Accept Cookies here\nplain line\n  see our PRIVACY POLICY and javascript  \n\nend",
        # 'İ' lowers to two characters: offsets in the lowered text shift, so lines are lowered
        # one by one instead.
        "İİİ İstanbul\nuse of cookies\nİ javascript İ\nnothing here",
        "javascriptjavascript\nterms of usE",
        "",
    ],
)
def test_boilerplate_lines_are_counted_as_line_by_line(text):
    spans = line_spans(text)
    expected = sum(
        1
        for s, e in spans
        if any(marker in text[s:e].lower() for marker in quality.BOILERPLATE_MARKERS)
    )
    assert quality._boilerplate_lines(text, spans) == expected


@pytest.mark.parametrize(
    "text",
    [
        "a b",
        "  ",
        "x\u00a0y z",
        "__ 12 _a a1 ١٢ ..- \u2028z",
        "Σ! -- ... — ok",
        "ǅ 3.5 #tag #",
        "½ ² ③ Ⅻ x 一二",  # numerals \w matches and \d does not: no letter (but 一 is one)
    ],
)
def test_word_statistics_match_the_token_by_token_definition(text):
    tokens = text.split()
    words_ = [t for t in tokens if re.search(r"\w", t)]
    scores = quality._word_scores(text, [])
    assert scores["word_count"] == len(words_)
    assert scores["mean_word_length"] == (sum(map(len, words_)) / len(words_) if words_ else 0.0)
    alpha = sum(1 for t in tokens if any(c.isalpha() for c in t))  # as DataTrove counts
    assert scores["alpha_word_fraction"] == (alpha / len(tokens) if tokens else 0.0)


def test_ascii_token_kinds_match_the_token_by_token_definition():
    """ASCII text counts its tokens with a letter and its symbol tokens from byte classes: the
    same counts as the definition (and the regex path non-ASCII text keeps), over every ASCII
    character."""
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(128)] + [" ", "a", "Z", "1", "_", "."] * 8
    texts = ["", "x", " x", "x ", "1 _ .", "a\x1cb 1\x1f_ \x0b!x", "\x00\x01 ab\x7f \x1dc1"]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 60))) for _ in range(3000)]
    for text in texts:
        assert text.isascii()
        tokens = text.split()
        expected = sum(1 for t in tokens if re.search(r"[^\W\d_]", t))
        symbols = [t for t in tokens if not re.search(r"\w", t)]
        kinds = (len(symbols), sum(map(len, symbols)), expected)
        assert quality._token_kinds(text, tokens) == kinds, repr(text)
        regex_path = len(tokens) - len(quality._no_letter_token().findall(text))
        assert regex_path == expected, repr(text)
        regex_symbols = quality._SYMBOL_TOKEN.findall(text)
        assert regex_symbols == symbols, repr(text)
