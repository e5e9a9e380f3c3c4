"""Property-based tests (hypothesis) of the API request models: for arbitrary JSON they raise
only validation errors (a 422), never anything that would be a 500."""

from __future__ import annotations

import contextlib
import json
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from pydantic import ValidationError

from jobstream.api import BatchRequest, JobRequest

# Tests write only under temp dirs: hypothesis' caches too (not ./.hypothesis).
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="hypothesis-"))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20)
_KEYS = st.sampled_from([*JobRequest.model_fields, "tenant_id", ""])
#: Objects shaped like a job request (its field names, any values, sometimes good ones).
JOB_LIKE = st.dictionaries(_KEYS, JSON | st.sampled_from(
    ["a.txt", "text/plain", "application/pdf", "batch", "aGk=", "a\x00b", "!!", ""]),
    max_size=8)
BATCH_LIKE = st.dictionaries(st.sampled_from(["documents", "lane", "x"]),
                             st.lists(JOB_LIKE, max_size=4) | JSON, max_size=3)
FAST = settings(max_examples=400, deadline=None, database=None,  # nothing written to the tree
                suppress_health_check=list(HealthCheck))


def _job(obj: object) -> None:
    try:
        req = JobRequest.model_validate(obj)
    except ValidationError:
        return
    with contextlib.suppress(ValueError):  # invalid base64: the API answers 422
        req.content()


@FAST
@given(st.one_of(JSON, JOB_LIKE))
def test_job_request_raises_only_validation_errors(obj: object) -> None:
    _job(obj)


@FAST
@given(st.one_of(JSON, BATCH_LIKE))
def test_batch_request_raises_only_validation_errors(obj: object) -> None:
    try:
        req = BatchRequest.model_validate(obj)
    except ValidationError:
        return
    for doc in req.documents:
        _job(doc.model_dump())


@FAST
@given(st.binary(max_size=200) | st.one_of(JSON, JOB_LIKE).map(lambda o: json.dumps(o).encode()))
def test_raw_bodies_raise_only_validation_errors(raw: bytes) -> None:
    for model in (JobRequest, BatchRequest):
        with contextlib.suppress(ValidationError):
            model.model_validate_json(raw)


@FAST
@given(st.text(min_size=1, max_size=20))
def test_a_filename_with_a_control_character_never_validates(name: str) -> None:
    has_control = any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name)
    try:
        JobRequest(filename=name, text="x")
    except ValidationError:
        assert has_control or len(name) > 512
        return
    assert not has_control
