"""The extractor on hostile documents built on the spot: each kind fails permanently with its
own code, in a child process that is killed at the deadline."""

from __future__ import annotations

import pytest

from jobstream.errors import PermanentError
from jobstream.textproc import DOCUMENT_ERROR_CODES, ExtractLimits, extract_text
from tests.hostile_documents import CORPUS, TEXT, bomb_pdf, good_pdf


@pytest.mark.parametrize("kind", sorted(CORPUS))
def test_each_hostile_kind_fails_with_its_own_code(kind: str) -> None:
    data, content_type, code = CORPUS[kind]()
    assert code in DOCUMENT_ERROR_CODES
    with pytest.raises(PermanentError) as err:
        extract_text(data, content_type)
    assert err.value.code == code, err.value


def test_limits_are_settings_not_constants() -> None:
    data = good_pdf(pages=3)
    assert extract_text(data, "application/pdf").page_count == 3
    with pytest.raises(PermanentError) as pages:
        extract_text(data, "application/pdf", ExtractLimits(max_pages=2))
    assert pages.value.code == "too_many_pages"
    with pytest.raises(PermanentError) as chars:
        extract_text(data, "application/pdf", ExtractLimits(max_text_chars=100))
    assert chars.value.code == "extracted_text_too_large"
    with pytest.raises(PermanentError) as plain:
        extract_text(TEXT.encode(), "text/plain", ExtractLimits(max_text_chars=100))
    assert plain.value.code == "extracted_text_too_large"
    # A bomb under the stream limit is just a page without text.
    small = bomb_pdf(inflated_bytes=2 * 1024 * 1024)
    with pytest.raises(PermanentError) as bomb:
        extract_text(small, "application/pdf", ExtractLimits(max_stream_bytes=1024 * 1024))
    assert bomb.value.code == "decompression_limit_exceeded"
    with pytest.raises(PermanentError) as blank:
        extract_text(small, "application/pdf")
    assert blank.value.code == "empty_document"


def test_extraction_past_its_deadline_is_killed_and_fails_permanently() -> None:
    # 50 ms cannot even start the child interpreter and import pypdf: it is killed.
    with pytest.raises(PermanentError) as err:
        extract_text(good_pdf(pages=40), "application/pdf", ExtractLimits(timeout_s=0.05))
    assert err.value.code == "extraction_timeout"


def test_an_unknown_content_type_is_its_own_code() -> None:
    with pytest.raises(PermanentError) as err:
        extract_text(b"<html>", "text/html")
    assert err.value.code == "unsupported_content_type"


def _pdf(objs: list[bytes]) -> bytes:
    out, offs = b"%PDF-1.4\n", []
    for i, o in enumerate(objs, 1):
        offs.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offs)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objs) + 1, xref)


def test_a_tounicode_map_to_a_lone_surrogate_does_not_fail_the_document() -> None:
    # Found by the adversarial pass: a font whose ToUnicode CMap maps a glyph to <D800> (broken
    # CMaps are common) made pypdf return a lone surrogate; the extract stage's sha256 / the
    # database could not encode it and the whole job failed as invalid_data.
    cmap = (b"/CIDInit /ProcSet findresource begin 1 begincodespacerange <0000> <FFFF> "
            b"endcodespacerange 2 beginbfchar <0001> <D800> <0002> <0041> endbfchar endcmap")
    content = b"BT /F1 12 Tf 72 712 Td <00010002> Tj ET"
    data = _pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 6 0 R >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(cmap), cmap)])
    text = extract_text(data, "application/pdf").text
    text.encode("utf-8")  # what the stage hashes and stores
    assert "\ufffd" in text and "A" in text, repr(text)


@pytest.mark.parametrize("text", [
    "Plain ASCII text.\tWith a tab.\r\nAnd CRLF line ends.\f",
    "Unicode: café, Straße, naïve, Zürich, 東京, emoji \U0001F600. " * 200,  # > the sniffed 8 KB
    "\x1b[1mtext with an ANSI escape\x1b[0m and words around it",
])
def test_text_is_not_mistaken_for_binary(text: str) -> None:
    assert extract_text(text.encode(), "text/plain").text.strip()
    assert extract_text("Le café crème coûte cher.".encode("latin-1"), "text/plain").text


def test_a_multibyte_character_cut_by_the_sniffed_prefix_is_still_text() -> None:
    data = b"a" * 7999 + "é".encode() + b" more text"  # the 8,000-byte cut splits the "é"
    assert extract_text(data, "text/plain").text.endswith("é more text")
