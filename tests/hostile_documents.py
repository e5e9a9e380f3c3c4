"""Hostile documents, built on the spot with pypdf / fpdf2 (no binary fixtures).

Each builder returns the document's bytes; :data:`CORPUS` maps a name to ``(bytes, content
type, the code extraction must fail with)``.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable

from fpdf import FPDF
from pypdf import PdfWriter
from pypdf.generic import NameObject, StreamObject

TEXT = ("Redistribution and use in source and binary forms, with or without modification, "
        "are permitted provided that the following conditions are met. ") * 20


def good_pdf(text: str = TEXT, pages: int = 1) -> bytes:
    """A PDF with a text layer on ``pages`` pages."""
    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for _ in range(pages):
        pdf.add_page()
        pdf.multi_cell(0, 6, text)
    return bytes(pdf.output())


def encrypted_pdf() -> bytes:
    """A readable PDF encrypted with a user password (it does not open with an empty one)."""
    writer = PdfWriter(clone_from=io.BytesIO(good_pdf()))
    writer.encrypt(user_password="s3cret", owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def image_only_pdf() -> bytes:
    """A scanned page: one image, no text layer."""
    from PIL import Image
    img = Image.new("RGB", (200, 100), (200, 30, 30))
    pdf = FPDF()
    pdf.add_page()
    pdf.image(img, x=10, y=10, w=100)
    return bytes(pdf.output())


def truncated_pdf() -> bytes:
    """The first 40% of a good PDF (a cut upload)."""
    data = good_pdf(pages=3)
    return data[: len(data) * 2 // 5]


def bomb_pdf(inflated_bytes: int = 80 * 1024 * 1024) -> bytes:
    """A small PDF whose one FlateDecode content stream inflates to ``inflated_bytes``."""
    writer = PdfWriter()
    page = writer.add_blank_page(612, 792)
    stream = StreamObject()
    stream._data = zlib.compress(b" " * inflated_bytes, 9)
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    page[NameObject("/Contents")] = writer._add_object(stream)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def many_pages_pdf(pages: int = 5000) -> bytes:
    """``pages`` blank pages (a page count far past any sensible limit)."""
    writer = PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(100, 100)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def slow_pdf(pages: int = 400) -> bytes:
    """Many pages of text: seconds of pypdf work (for the extraction deadline)."""
    return good_pdf(pages=pages)



CORPUS: dict[str, Callable[[], tuple[bytes, str, str]]] = {
    "encrypted": lambda: (encrypted_pdf(), "application/pdf", "encrypted_document"),
    "image_only": lambda: (image_only_pdf(), "application/pdf", "image_only_document"),
    "truncated": lambda: (truncated_pdf(), "application/pdf", "unparseable_document"),
    "bomb": lambda: (bomb_pdf(), "application/pdf", "decompression_limit_exceeded"),
    "text_named_pdf": lambda: (TEXT.encode(), "application/pdf", "not_a_pdf"),
    "empty": lambda: (b"", "application/pdf", "empty_document"),
    "huge_page_count": lambda: (many_pages_pdf(), "application/pdf", "too_many_pages"),
    # Binary data sent as text: without the check these "succeeded" with a garbage result.
    "png_as_text": lambda: (b"\x89PNG\r\n\x1a\nabc", "text/plain", "unsupported_content_type"),
    "nul_bytes_as_text": lambda: (TEXT.encode()[:200] + b"\x00\x01\x02" + TEXT.encode()[:200],
                                  "text/plain", "unsupported_content_type"),
    "control_bytes_as_text": lambda: (bytes(range(1, 9)) * 50 + b"words", "text/plain",
                                      "unsupported_content_type"),
}
