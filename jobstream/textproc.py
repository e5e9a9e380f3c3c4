"""Text extraction (plain text, and PDF via pypdf in a bounded child process) and chunking.

A document is hostile until proven otherwise. Plain text is decoded in process (its size is
bounded by the intake limit); a PDF is parsed by pypdf in a child process
(``python -m jobstream.textproc``) that gets the bytes on stdin, no environment secrets, an
address-space limit and a deadline after which it is killed, so no PDF can hang, crash or
exhaust a stage worker. Every way a document can be unusable is a :class:`PermanentError` with
its own stable code (:data:`DOCUMENT_ERROR_CODES`): retrying cannot fix the document.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from jobstream.errors import PermanentError, RetryableError

#: Every code a document can fail extraction with, and what it means.
DOCUMENT_ERROR_CODES = {
    "empty_document": "no bytes, or no text in them",
    "unsupported_content_type": "neither text/plain nor application/pdf, or binary data (an "
                                "image, an archive...) sent as text/plain",
    "not_a_pdf": "sent as application/pdf but has no %PDF- header in its first 1024 bytes",
    "unparseable_document": "pypdf cannot read it (any PyPdfError, or a malformed structure)",
    "encrypted_document": "the PDF is encrypted and does not open with an empty password",
    "image_only_document": "the PDF has pages with images but no text layer (needs OCR)",
    "too_many_pages": "more pages than JOBSTREAM_EXTRACT_MAX_PAGES",
    "extracted_text_too_large": "more text than JOBSTREAM_EXTRACT_MAX_TEXT_CHARS",
    "decompression_limit_exceeded": "a stream inflates past JOBSTREAM_EXTRACT_MAX_STREAM_BYTES",
    "extraction_memory_exceeded": "parsing needed more than JOBSTREAM_EXTRACT_MAX_MEMORY_BYTES",
    "extraction_timeout": "parsing took longer than JOBSTREAM_EXTRACT_TIMEOUT_S",
    "extraction_failed": "the extractor process died without an answer (e.g. a crash)",
}

#: The extractor chosen for each content type: part of the dedup identity (keys.dedup_key),
#: because the same bytes read by another extractor give another text.
EXTRACTORS = {"text/plain": "text", "application/pdf": "pypdf"}


def extractor_for(content_type: str) -> str:
    """The extractor name for ``content_type`` (``text`` or ``pypdf``). Raises
    :class:`PermanentError` ``unsupported_content_type``."""
    try:
        return EXTRACTORS[content_type]
    except KeyError:
        raise PermanentError(f"unsupported content type {content_type!r}",
                             code="unsupported_content_type") from None


@dataclass(frozen=True)
class ExtractLimits:
    """Bounds on the work one document may cause (see the ``extract_*`` settings).

    ``max_pages`` (PDF pages), ``max_text_chars`` (characters of extracted text),
    ``max_stream_bytes`` (bytes one decompressed PDF stream may reach), ``max_memory_bytes``
    (address space of the PDF child process, bytes), ``timeout_s`` (wall time of the PDF child
    process, seconds).
    """

    max_pages: int = 1000
    max_text_chars: int = 2_000_000
    max_stream_bytes: int = 32 * 1024 * 1024
    max_memory_bytes: int = 1024 * 1024 * 1024
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Extracted:
    """Extracted text and the PDF page count (0 for plain text)."""

    text: str
    page_count: int


def extract_text(content: bytes, content_type: str,
                 limits: ExtractLimits | None = None) -> Extracted:
    """Extract the text of a document within ``limits``.

    ``text/plain`` is decoded as UTF-8 (latin-1 as fallback); ``application/pdf`` is read with
    pypdf page by page in a child process (:func:`_run_pdf_child`). Raises
    :class:`PermanentError` with one of :data:`DOCUMENT_ERROR_CODES`, or
    :class:`RetryableError` ``extractor_unavailable`` when the child process cannot be started.
    """
    limits = limits or ExtractLimits()
    extractor_for(content_type)
    if not content.strip():
        raise PermanentError("the document is empty", code="empty_document")
    if content_type == "text/plain":
        _refuse_binary(content)
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            text = content.decode("latin-1")
        pages = 0
    else:
        if b"%PDF-" not in content[:1024]:
            raise PermanentError("sent as application/pdf but it has no %PDF- header",
                                 code="not_a_pdf")
        text, pages = _run_pdf_child(content, limits)
    text = text.replace("\x00", "").replace("\r\n", "\n")
    # A broken ToUnicode CMap can give pypdf lone surrogates, which no UTF-8 (hash, database)
    # can hold: pairs become their character, lone ones U+FFFD.
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if len(text) > limits.max_text_chars:
        raise PermanentError(f"{len(text)} characters of text; the limit is "
                             f"{limits.max_text_chars}", code="extracted_text_too_large")
    if not text.strip():
        raise PermanentError("the document has no text", code="empty_document")
    return Extracted(text=text, page_count=pages)


#: Leading bytes of common binary formats (PNG, JPEG, GIF, zip/docx/xlsx, gzip, xz, 7z, ELF):
#: never plain text. (Others, e.g. Windows executables, hold NUL bytes early.)
BINARY_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"PK\x03\x04",
                     b"\x1f\x8b", b"\xfd7zXZ\x00", b"7z\xbc\xaf\x27\x1c", b"\x7fELF")
#: How many leading bytes the binary check reads (git's ``buffer_is_binary`` reads 8,000).
BINARY_SNIFF_BYTES = 8000
#: Control characters (C0 other than tab, line feed, form feed, carriage return, escape;
#: DEL; C1) above this share of the sniffed text make it binary.
BINARY_CONTROL_SHARE = 0.1
_TEXT_CONTROLS = frozenset(b"\t\n\x0b\x0c\r\x1b")
#: The control characters that count towards :data:`BINARY_CONTROL_SHARE`: C0 except
#: :data:`_TEXT_CONTROLS`, DEL and C1 (one regex pass: 8 KB in ~20 us, not ~400 us; issue 12).
_BINARY_CONTROLS = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x9f]")


def _refuse_binary(content: bytes) -> None:
    """Refuse binary data sent as ``text/plain`` (an image, an archive, an executable): it
    would otherwise "succeed" with a garbage result (and be billed by a remote provider).

    Binary when the first :data:`BINARY_SNIFF_BYTES` bytes hold a NUL byte (git's rule,
    ``buffer_is_binary`` in git's xdiff-interface.c), start with one of
    :data:`BINARY_SIGNATURES`, or are more than :data:`BINARY_CONTROL_SHARE` control bytes.
    Raises :class:`PermanentError` ``unsupported_content_type``.
    """
    head = content[:BINARY_SNIFF_BYTES]
    why = None
    if b"\x00" in head:
        why = "it contains NUL bytes"
    elif head.startswith(BINARY_SIGNATURES):
        why = f"it starts like a binary file format ({head[:8]!r})"
    else:
        try:
            sample = head.decode("utf-8")
        except UnicodeDecodeError as exc:  # a multi-byte character cut at the sniff's end
            sample = head[:exc.start].decode("utf-8") if exc.start > len(head) - 4 else \
                head.decode("latin-1")
        controls = len(_BINARY_CONTROLS.findall(sample))
        if sample and controls / len(sample) > BINARY_CONTROL_SHARE:
            why = f"{controls} of its first {len(sample)} characters are control characters"
    if why:
        raise PermanentError(f"binary data sent as text/plain: {why}; jobstream reads plain "
                             "text and PDF documents", code="unsupported_content_type")


def _run_pdf_child(content: bytes, limits: ExtractLimits) -> tuple[str, int]:
    """Parse a PDF in a child process killed after ``limits.timeout_s`` seconds. Returns
    ``(text, page_count)``; raises like :func:`extract_text`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": root,
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    try:
        proc = subprocess.run([sys.executable, "-m", "jobstream.textproc",
                               json.dumps(asdict(limits))], input=content,
                              capture_output=True, timeout=limits.timeout_s, env=env,
                              cwd=root)
    except subprocess.TimeoutExpired:
        raise PermanentError(f"PDF extraction took longer than {limits.timeout_s}s; the "
                             "extractor was killed", code="extraction_timeout") from None
    except OSError as exc:
        raise RetryableError(f"cannot start the PDF extractor: {exc}",
                             code="extractor_unavailable") from None
    try:
        answer = json.loads(proc.stdout)
    except ValueError:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        if b"MemoryError" in proc.stderr:
            raise PermanentError(f"PDF extraction needed more than {limits.max_memory_bytes} "
                                 "bytes of memory", code="extraction_memory_exceeded") from None
        raise PermanentError(f"the PDF extractor died (exit {proc.returncode}): {tail[0][:300]}",
                             code="extraction_failed") from None
    if "error_code" in answer:
        raise PermanentError(answer["message"], code=answer["error_code"])
    return answer["text"], answer["page_count"]


def _has_images(page: Any) -> bool:  # a pypdf PageObject: PDF objects are dynamically typed
    try:
        xobjects = page["/Resources"].get_object().get("/XObject")
        if xobjects is None:
            return False
        xobjects = xobjects.get_object()
        return any(xobjects[n].get_object().get("/Subtype") == "/Image" for n in xobjects)
    except Exception:  # noqa: BLE001 - a malformed resource dict just has no image we can see
        return False


def _decode_contents(page: Any) -> None:  # a pypdf PageObject
    """Decode the page's content streams (pypdf caches the result for ``extract_text``), so a
    decompression limit raises here instead of silently giving an empty page."""
    contents = page.get("/Contents")
    if contents is None:
        return
    contents = contents.get_object()
    for stream in contents if isinstance(contents, list) else [contents]:
        stream = stream.get_object()
        if hasattr(stream, "get_data"):
            stream.get_data()


def _pdf_text(content: bytes, limits: ExtractLimits) -> tuple[str, int]:
    """The child's work: pypdf with its decompression limits set to ``limits``. Raises
    :class:`PermanentError` with a code of :data:`DOCUMENT_ERROR_CODES`."""
    import dataclasses

    import pypdf
    from pypdf import PdfReader
    from pypdf.errors import FileNotDecryptedError, LimitReachedError, PyPdfError

    cap = limits.max_stream_bytes
    if hasattr(pypdf, "overwrite_configuration"):  # pypdf >= 7: one configuration object
        known = {f.name for f in dataclasses.fields(pypdf.Configuration)}
        pypdf.overwrite_configuration(None, **{name: cap for name in (
            "maximum_declared_stream_length", "array_based_stream_maximum_output_length",
            "jbig2_maximum_output_length", "lzw_maximum_output_length",
            "run_length_maximum_output_length", "zlib_maximum_output_length",
            "brotli_maximum_output_length", "image_maximum_buffer_size") if name in known})
    else:  # older pypdf: module constants
        import pypdf.filters
        for name in ("ZLIB_MAX_OUTPUT_LENGTH", "LZW_MAX_OUTPUT_LENGTH",
                     "MAX_DECLARED_STREAM_LENGTH", "MAX_ARRAY_BASED_STREAM_OUTPUT_LENGTH"):
            if name in vars(pypdf.filters):
                setattr(pypdf.filters, name, cap)
    try:
        reader = PdfReader(io.BytesIO(content))
        if reader.is_encrypted:
            try:
                opened = bool(reader.decrypt(""))
            except (PyPdfError, NotImplementedError, ValueError):
                opened = False
            if not opened:
                raise PermanentError("the PDF is encrypted", code="encrypted_document")
        pages = len(reader.pages)
        if pages > limits.max_pages:
            raise PermanentError(f"{pages} pages; the limit is {limits.max_pages}",
                                 code="too_many_pages")
        parts: list[str] = []
        total = 0
        for page in reader.pages:
            _decode_contents(page)  # pypdf's extract_text swallows LimitReachedError
            part = page.extract_text() or ""
            total += len(part)
            if total > limits.max_text_chars:
                raise PermanentError(f"more than {limits.max_text_chars} characters of text",
                                     code="extracted_text_too_large")
            parts.append(part)
        text = "\n".join(parts)
        if pages and not text.replace("\x00", "").strip() and any(
                _has_images(p) for p in reader.pages):
            raise PermanentError("the PDF has images but no text layer (it needs OCR)",
                                 code="image_only_document")
    except PermanentError:
        raise
    except FileNotDecryptedError:
        raise PermanentError("the PDF is encrypted", code="encrypted_document") from None
    except LimitReachedError as exc:
        raise PermanentError(f"a PDF stream exceeds the decompression limit of "
                             f"{limits.max_stream_bytes} bytes: {exc}",
                             code="decompression_limit_exceeded") from None
    except MemoryError:
        raise PermanentError(f"PDF extraction needed more than {limits.max_memory_bytes} bytes "
                             "of memory", code="extraction_memory_exceeded") from None
    except (PyPdfError, RecursionError, Exception) as exc:  # noqa: BLE001 - hostile input
        raise PermanentError(f"PDF cannot be read: {type(exc).__name__}: {exc}"[:1000],
                             code="unparseable_document") from None
    return text, pages


def _child_main(argv: list[str]) -> int:
    """Entry of the PDF child process: limits as JSON in ``argv[0]``, the PDF on stdin, one
    JSON object on stdout (``text`` + ``page_count``, or ``error_code`` + ``message``)."""
    import logging
    import resource
    limits = ExtractLimits(**json.loads(argv[0]))
    logging.disable(logging.WARNING)  # pypdf's complaints about a hostile file are noise
    content = sys.stdin.buffer.read()
    mem = limits.max_memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    try:
        text, pages = _pdf_text(content, limits)
        answer: dict[str, object] = {"text": text, "page_count": pages}
    except PermanentError as exc:
        answer = {"error_code": exc.code, "message": str(exc)}
    sys.stdout.write(json.dumps(answer))
    return 0


@dataclass(frozen=True)
class Chunk:
    """One chunk: its index, half-open character span ``[start, end)`` in the text, its text."""

    idx: int
    start: int
    end: int
    text: str


#: A blank line after a paragraph's last (non-blank) character: a newline, whitespace without
#: a newline, a newline (a literal first: the regex engine skips to each newline).
_PARAGRAPH_END = re.compile(r"\n(?<=\S\n)[^\S\n]*\n")
_NON_BLANK = re.compile(r"\S")


def paragraphs(text: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` offsets of the paragraphs of ``text``, in order: from a non-blank
    character to the first LATER non-blank character followed by a blank line (or the last
    non-blank character of the text), inclusive; a paragraph of one character ends there only
    when no later end exists (the pattern's optional group is greedy). The same spans as
    ``re.finditer(r"\\S(?:.*?\\S)?(?=\\n\\s*\\n|\\s*\\Z)", text, flags=re.S)``, whose lazy
    match tried the look-ahead at every character (~80 us per 3 KB; this: ~10; issue 12)."""
    last = len(text.rstrip())  # str.isspace() is what \s matches
    ends = [m.start() for m in _PARAGRAPH_END.finditer(text)]
    ends.append(last)
    out: list[tuple[int, int]] = []
    pos = i = 0
    while (m := _NON_BLANK.search(text, pos)) is not None and m.start() < last:
        start = m.start()
        while i < len(ends) and ends[i] <= start + 1:
            i += 1
        pos = ends[i] if i < len(ends) else start + 1  # then start + 1 == last
        out.append((start, pos))
    return out


def chunk_text(text: str, size: int) -> list[Chunk]:
    """Split ``text`` into chunks of at most about ``size`` characters on paragraph breaks.

    Paragraphs (blank-line separated) are packed greedily; a paragraph longer than ``size`` is
    cut at the last whitespace before the limit. Every non-blank character lands in exactly one
    chunk. Returns at least one chunk for non-blank text.
    """
    spans: list[tuple[int, int]] = []
    for start, end in paragraphs(text):
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
            assert cur_end is not None  # set together with cur_start
            chunks.append(Chunk(len(chunks), cur_start, cur_end, text[cur_start:cur_end]))
            cur_start, cur_end = start, end
    if cur_start is not None and cur_end is not None:
        chunks.append(Chunk(len(chunks), cur_start, cur_end, text[cur_start:cur_end]))
    return chunks


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
