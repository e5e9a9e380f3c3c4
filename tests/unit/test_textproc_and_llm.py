"""Text extraction, chunking, the local model and the provider client's classification."""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from jobstream.drills.demo import make_pdf
from jobstream.errors import PermanentError
from jobstream.llm.client import ProviderClient, backoff_s, parse_retry_after
from jobstream.llm.local import analyse
from jobstream.llm.profiles import get_profile
from jobstream.textproc import chunk_text, extract_text
from streams.validate import merge_analyses

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _nonspace(s: str) -> str:
    return re.sub(r"\s", "", s)


@pytest.mark.parametrize("size", [200, 1000, 4000, 100_000])
def test_chunks_cover_every_character_once_and_respect_the_size(size: int) -> None:
    text = GPL3.read_text()
    chunks = chunk_text(text, size)
    assert _nonspace("".join(c.text for c in chunks)) == _nonspace(text)
    assert [c.idx for c in chunks] == list(range(len(chunks)))
    assert all(len(c.text) <= size for c in chunks)
    assert all(text[c.start:c.end] == c.text for c in chunks)


def test_plain_text_and_latin1_fallback() -> None:
    assert extract_text("héllo".encode(), "text/plain").text == "héllo"
    assert extract_text("héllo".encode("latin-1"), "text/plain").text == "héllo"


def test_empty_and_broken_documents_are_permanent_failures() -> None:
    with pytest.raises(PermanentError) as e1:
        extract_text(b"  \n\n ", "text/plain")
    assert e1.value.code == "empty_document"
    with pytest.raises(PermanentError) as e2:
        extract_text(b"%PDF-1.4 garbage", "application/pdf")
    assert e2.value.code == "unparseable_document"


def test_pdf_made_with_fpdf2_is_extracted_by_pypdf(tmp_path: Path) -> None:
    src = Path("/usr/share/common-licenses/BSD").read_text()
    pdf = make_pdf(src, tmp_path / "bsd.pdf", "BSD")
    got = extract_text(pdf.read_bytes(), "application/pdf")
    assert got.page_count >= 1
    assert "Redistribution and use in source and binary forms" in " ".join(got.text.split())


def test_local_model_is_deterministic_and_extractive() -> None:
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()
    a, b = analyse(text), analyse(text)
    assert a == b
    assert a["title"] == "Apache License"
    assert a["fields"]["version"] == "2.0"
    for sentence in re.split(r"(?<=\.)\s", a["summary"]):
        assert " ".join(sentence.split())[:60] in " ".join(text.split())


def test_local_profile_goes_through_the_openai_request_path() -> None:
    client = ProviderClient(get_profile("local"), timeout_s=5)
    try:
        got = client.complete("system", "Version 3 of the thing. It was written in 2007 here.")
    finally:
        client.close()
    assert got.status_code == 200
    assert got.content["fields"]["years"] == ["2007"]
    assert got.prompt_tokens > 0 and got.completion_tokens > 0


def test_retry_after_seconds_and_http_date() -> None:
    assert parse_retry_after("7") == 7.0
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(later, now=now.timestamp()) == pytest.approx(30, abs=1)
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_full_jitter_backoff_stays_within_the_capped_window() -> None:
    rng = random.Random(1)
    for attempt in range(10):
        b = backoff_s(attempt, 0.5, 8.0, rng)
        assert 0 <= b <= min(8.0, 0.5 * 2 ** attempt)


def test_merge_validates_and_ranks_keywords() -> None:
    parts = [{"title": "T", "summary": "One.", "keywords": ["a", "b"], "word_count": 3,
              "fields": {"years": ["2001"]}},
             {"title": None, "summary": "Two.", "keywords": ["b"], "word_count": 2,
              "fields": {"years": ["1999"], "version": "2"}}]
    got = merge_analyses("f.txt", parts)
    assert got.title == "T" and got.word_count == 5 and got.chunk_count == 2
    assert got.keywords[0] == "b"
    assert got.fields == {"years": ["1999", "2001"], "version": "2"}
    with pytest.raises(PermanentError) as exc:
        merge_analyses("f.txt", [{"summary": "x"}])  # keywords missing
    assert exc.value.code == "invalid_model_output"


def test_get_prompt_raises_the_code_its_docstring_names() -> None:
    import pytest

    from jobstream.errors import PermanentError
    from jobstream.llm.profiles import get_prompt

    with pytest.raises(PermanentError) as info:
        get_prompt("no-such-prompt")
    assert info.value.code == "unknown_prompt_version"
    assert info.value.code in (get_prompt.__doc__ or "")


def test_local_model_keeps_words_of_every_script() -> None:
    """Arabic words count, accented Latin words keep their accents, CJK text (no spaces between
    words) gives character-bigram keywords; sentences split after Arabic and CJK punctuation."""
    from jobstream.llm.local import sentences, words
    arabic = ("يعتبر الذكاء الاصطناعي مجالا مهما. الذكاء الاصطناعي يغير العالم اليوم. "
              "يدرس الطلاب الذكاء الاصطناعي في الجامعات؟ نعم يدرسونه كثيرا هناك.")
    a = analyse(arabic)
    assert {"الذكاء", "الاصطناعي"} <= set(a["keywords"][:2])
    assert "في" not in a["keywords"]
    latin = ("Le café de Paris est célèbre. Un café crème coûte cher à Zürich. "
             "Die Straße zum Café ist schön und naïve Touristen mögen das Café.")
    la = analyse(latin)
    assert la["keywords"][0] == "café" and "caf" not in la["keywords"]
    assert {"célèbre", "straße", "naïve", "zürich"} <= set(words(latin))
    # NFD input (e + combining accent) is the same word as NFC
    assert words("cafe\u0301 cafe\u0301") == ["café", "café"]
    cjk = ("機械学習は人工知能の一分野です。機械学習はデータから学習します。"
           "多くの企業が機械学習を使っています。")
    c = analyse(cjk)
    assert {"機械", "学習"} <= set(c["keywords"][:3])
    assert len(sentences(cjk)) == 3
    assert c["summary"].startswith("機械学習は")
    assert sentences("Le chat dort. e.g. this stays. Fin.") == ["Le chat dort. e.g. this stays.",
                                                               "Fin."]
    assert len(sentences(arabic)) == 4


@pytest.mark.parametrize("text", [
    "Le chat dort. e.g. this stays. Fin.\n\nAnother  paragraph\twith  tabs!  Done?",
    "機械学習は人工知能の一分野です。機械学習はデータから学習します。ABCは英語です",
    "يعتبر الذكاء الاصطناعي مجالا مهما. الذكاء الاصطناعي يغير العالم؟ نعم",
    "cafe\u0301 crème. Straße\u2028zum «Café». Don't stop—well-known co-op's 2nd try.",
    "Version 2.1 (2007). See https://example.org/x. Mail a@b.org!",
    "",
])
def test_the_words_of_a_text_are_its_sentences_words_in_order(text: str) -> None:
    """The local model counts keyword frequencies from its sentences' words (one tokenising
    pass, issue 12): that is the same as the text's words only while no word spans a sentence
    cut; a change to the word or sentence patterns that breaks it fails here."""
    from jobstream.llm.local import sentences, words
    flat = " ".join(text.split())
    assert [w for s in sentences(flat) for w in words(s)] == words(text)


@pytest.mark.parametrize("text", [
    "Don't re-use X-1, a-b 3d o'clock; ABC--def ab-'cd x'-y 'quoted' end.",
    "Copyright (C) 2007 Free Software Foundation, Inc. <https://fsf.org/> e.g. this 3rd x9y",
    "MIT-licensed -leading trailing- it''s don''t a'b'c 1st 2nd version2 v2.0 UPPER Mixed",
    "".join(chr(random.Random(7).randrange(32, 127)) for _ in range(3000)),
])
def test_ascii_fast_path_finds_the_same_words_as_the_general_tokeniser(text: str) -> None:
    """Issue 12: :func:`words` takes one regex pass over lower-cased ASCII text; the words
    must be exactly those the general (any-script) tokeniser finds."""
    from jobstream.llm.local import _words_any, words
    assert text.isascii()
    assert words(text) == _words_any(text)
    assert words(text)  # something was found


def test_binary_sniff_counts_the_same_control_characters() -> None:
    """Issue 12: the control-character share of the binary sniff is one regex pass; it must
    count exactly C0 but tab, LF, VT, FF, CR and ESC, plus DEL and C1."""
    from jobstream import textproc
    for c in range(0x300):
        counted = bool(textproc._BINARY_CONTROLS.fullmatch(chr(c)))
        assert counted == ((c < 0x20 and c not in textproc._TEXT_CONTROLS)
                           or 0x7f <= c <= 0x9f), hex(c)


def test_paragraphs_are_the_spans_of_the_old_pattern() -> None:
    """Issue 12: :func:`jobstream.textproc.paragraphs` replaced a lazy regex that tried its
    look-ahead at every character; it must find exactly the same spans, quirks included (a
    one-character paragraph runs on to the next paragraph's end; trailing blanks on a line
    do not end a paragraph; Unicode whitespace counts as blank)."""
    from jobstream.textproc import paragraphs
    old = re.compile(r"\S(?:.*?\S)?(?=\n\s*\n|\s*\Z)", re.S)
    rnd = random.Random(12)
    pieces = ["a", "b.", " ", "\n", "\t", "\r", "\u00a0", "\u2003", "\x0b", "\x0c", "\u2028",
              "\x1c", "é", "\n\n", " \n", "\n \n", "word "]
    texts = ["", "x", "x\n\ny", "a \n\nb", "b\n \n.c\n\n", "  one\n\n\n two  \n\n"]
    texts += ["".join(rnd.choice(pieces) for _ in range(rnd.randrange(40))) for _ in range(5000)]
    for text in texts:
        assert paragraphs(text) == [m.span() for m in old.finditer(text)], repr(text)


@pytest.mark.parametrize("text", [
    "GNU GENERAL PUBLIC LICENSE VERSION 3, 29 June 2007; (c) 1999-2020, 2100, 19999, x1999",
    "subversion 2 is no version; then vErSiOn\n4.1.2. and Version 5", "version 7_2019 _2020",
    "Verſion 3 (a long s matches case-insensitively) from 2001", "Version İ 9 2024 ٢٠٢٤",
    "no fields here at all",
])
def test_version_and_years_fields_match_the_original_patterns(text: str) -> None:
    """Issue 12: the ``version`` and ``years`` fields use faster patterns (a case-sensitive
    search on lower-cased ASCII text, the word boundary checked behind the digits); they must
    give what the original case-insensitive / boundary-first patterns give."""
    fields = analyse(text)["fields"]
    m = re.search(r"\bVersion\s+(\d+(?:\.\d+)*)", text, flags=re.I)
    assert fields.get("version") == (m.group(1) if m else None)
    years = sorted(set(re.findall(r"\b(?:19|20)\d\d\b", text, flags=re.ASCII)))[:10]
    assert fields.get("years") == (years or None)
