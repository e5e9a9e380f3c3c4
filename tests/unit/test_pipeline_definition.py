"""The pipeline is defined once (``schemas/pipeline.py``): a stage added to a copy of the
definition appears in the topics, the AsyncAPI document and the CLI's choices without any
other module changing; and the real definition is what those modules actually use."""

from __future__ import annotations

import dataclasses
from typing import Literal

import click
import pytest

from jobstream import cli, kafka
from jobstream.settings import Settings
from schemas import asyncapi
from schemas.events import EVENT_MODELS, Validated
from schemas.pipeline import OLD_NAMES, PIPELINE, Pipeline, Stage


class Translated(Validated):
    """``job.translated``: a pure stage's output, for this test only."""

    event_type: Literal["job.translated"] = "job.translated"  # type: ignore[assignment]  # a narrower Literal, as every event model declares


def _with_translate() -> Pipeline:
    """A copy of the real pipeline with one more stage, ``translate``, before ``publish``."""
    stages = list(PIPELINE.stages)
    i = PIPELINE.names.index("publish")
    translate = Stage("translate", stages[i - 1].emits, "job.translated", "translate-1",
                      "translates the analysis")
    stages[i:i + 1] = [translate, dataclasses.replace(stages[i], consumes="job.translated")]
    return Pipeline(stages=tuple(stages))


def test_an_added_stage_appears_in_topics_asyncapi_and_cli_choices() -> None:
    p = _with_translate()
    assert p.names == ("intake", "extract", "chunk", "llm", "validate", "translate", "publish")

    # Topics `jobstream topics` creates: the stage's input, its .retry and .dlq twins.
    names = kafka.logical_topics(p)
    assert {"job.translated", "job.translated.retry", "job.translated.dlq"} <= set(names)
    assert "job.translated" not in kafka.logical_topics()  # the real pipeline is untouched
    assert "p.job.translated.retry" in kafka.all_topics(Settings(topic_prefix="p."), p)

    # AsyncAPI: channels, operations and the payload of the new event's model.
    doc = asyncapi.render(p, models={**EVENT_MODELS, "job.translated": Translated})
    for cid in ("job_translated", "job_translated_retry", "job_translated_dlq"):
        assert cid in doc["channels"], cid
    assert doc["components"]["messages"]["job_translated"]["payload"] == {
        "$ref": "#/components/schemas/Translated"}
    assert doc["channels"]["job_validated"]["description"] == (
        "Produced by stage validate; consumed by stage translate.")
    assert doc["channels"]["job_translated"]["description"] == (
        "Produced by stage translate; consumed by stage publish.")
    assert "receive_job_translated" in doc["operations"]

    # CLI: worker --stages and redrive --from offer it.
    assert "translate" in cli.worker_stage_choices(p)
    assert cli.redrive_stage_choices(p)[-2:] == ("translate", "publish")


def test_the_modules_derive_from_the_real_definition() -> None:
    assert PIPELINE.topics() == kafka.PIPELINE_TOPICS
    assert PIPELINE.stage_topics() == kafka.STAGE_TOPICS
    assert asyncapi.render_text() == asyncapi.OUT.read_text()  # committed = derived

    redrive = cli.main.commands["redrive"]
    [from_opt] = [o for o in redrive.params if o.name == "from_stage"]
    assert isinstance(from_opt.type, click.Choice)
    assert tuple(from_opt.type.choices) == cli.redrive_stage_choices() == (
        "extract", "chunk", "llm", "validate", "publish")
    worker = cli.main.commands["worker"]
    [stages_opt] = [o for o in worker.params if o.name == "stages"]
    assert ", ".join(cli.worker_stage_choices()) in (stages_opt.help or "")


def test_old_checkpoint_names_are_accepted_with_a_deprecation_message(
        capsys: pytest.CaptureFixture[str]) -> None:
    from click.testing import CliRunner

    redrive = cli.main.commands["redrive"]
    [from_opt] = [o for o in redrive.params if o.name == "from_stage"]
    for old, new in OLD_NAMES.items():
        if new == "intake":
            continue  # intake is not a redrive target, under either name
        assert from_opt.type.convert(old, from_opt, None) == new
        assert f"stage name {old!r} is deprecated; use {new!r}" in capsys.readouterr().err
    with pytest.raises(click.BadParameter):
        from_opt.type.convert("uploaded", from_opt, None)
    out = CliRunner().invoke(cli.main, ["redrive", "--help"])
    assert "text_extracted" not in out.output and "extract" in out.output


def test_a_broken_chain_is_refused() -> None:
    stages = list(PIPELINE.stages)
    stages[2] = dataclasses.replace(stages[2], consumes="job.accepted.v2")
    with pytest.raises(ValueError, match="consumes job.accepted.v2"):
        Pipeline(stages=tuple(stages))
    with pytest.raises(ValueError, match="repeat"):
        Pipeline(stages=(*PIPELINE.stages, dataclasses.replace(PIPELINE.stages[-1],
                                                                consumes="job.ready")))
