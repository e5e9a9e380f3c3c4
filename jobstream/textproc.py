"""Text extraction (plain text and PDF via pypdf) and chunking: pure functions, no I/O."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from pypdf import PdfReader
from pypdf.errors import PdfReadError

from jobstream.errors import PermanentError

EXTRACT_VERSION = "extract-1"
CHUNK_VERSION = "chunk-1"


@dataclass(frozen=True)
class Extracted:
    """Extracted text and the PDF page count (0 for plain text)."""

    text: str
    page_count: int


def extract_text(content: bytes, content_type: str) -> Extracted:
    """Extract the text of a document.

    ``text/plain`` is decoded as UTF-8 (latin-1 as fallback); ``application/pdf`` is read with
    pypdf page by page. Raises :class:`PermanentError` (``unparseable_document``,
    ``empty_document``, ``unsupported_content_type``): retrying cannot fix the document.
    """
    if content_type == "text/plain":
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            text = content.decode("latin-1")
        pages = 0
    elif content_type == "application/pdf":
        try:
            reader = PdfReader(io.BytesIO(content))
            parts = [page.extract_text() or "" for page in reader.pages]
        except (PdfReadError, ValueError, KeyError, TypeError) as exc:
            raise PermanentError(f"PDF cannot be read: {exc}",
                                 code="unparseable_document") from None
        text, pages = "\n".join(parts), len(parts)
    else:
        raise PermanentError(f"unsupported content type {content_type!r}",
                             code="unsupported_content_type")
    text = text.replace("\x00", "").replace("\r\n", "\n")
    if not text.strip():
        raise PermanentError("the document has no text", code="empty_document")
    return Extracted(text=text, page_count=pages)


@dataclass(frozen=True)
class Chunk:
    """One chunk: its index, half-open character span ``[start, end)`` in the text, its text."""

    idx: int
    start: int
    end: int
    text: str


def chunk_text(text: str, size: int) -> list[Chunk]:
    """Split ``text`` into chunks of at most about ``size`` characters on paragraph breaks.

    Paragraphs (blank-line separated) are packed greedily; a paragraph longer than ``size`` is
    cut at the last whitespace before the limit. Every non-blank character lands in exactly one
    chunk. Returns at least one chunk for non-blank text.
    """
    spans: list[tuple[int, int]] = []
    for m in re.finditer(r"\S(?:.*?\S)?(?=\n\s*\n|\s*\Z)", text, flags=re.S):
        start, end = m.start(), m.end()
        while end - start > size:
            cut = text.rfind(" ", start + size // 2, start + size)
            cut = cut if cut > start else start + size
            spans.append((start, cut))
            start = cut
            while start < end and text[start].isspace():
                start += 1
        if end > start:
            spans.append((start, end))
    chunks: list[Chunk] = []
    cur_start = cur_end = None
    for start, end in spans:
        if cur_start is None:
            cur_start, cur_end = start, end
        elif end - cur_start <= size:
            cur_end = end
        else:
            chunks.append(Chunk(len(chunks), cur_start, cur_end, text[cur_start:cur_end]))
            cur_start, cur_end = start, end
    if cur_start is not None and cur_end is not None:
        chunks.append(Chunk(len(chunks), cur_start, cur_end, text[cur_start:cur_end]))
    return chunks
