"""Source specs on the command line: ``name[key=value,...]`` (``specdraft.source_spec``)."""

from __future__ import annotations

from typing import Any

import pytest

from specdraft import cli
from specdraft.source_spec import SourceSpecError, parse_source_spec, split_top_level


class Recorder:
    """A stand-in source that records its constructor arguments."""

    def __init__(self, size: int = 1, rate: float = 0.5, flag: bool = False, label: Any = "x") -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.kwargs = dict(size=size, rate=rate, flag=flag, label=label)


REGISTRY = {"rec": Recorder, "other": Recorder}


def test_split_top_level_keeps_bracketed_commas() -> None:
    assert split_top_level("a, b[x=1,y=2] ,,c") == ["a", "b[x=1,y=2]", "c"]
    assert split_top_level("a+b[x=1]", "+") == ["a", "b[x=1]"]
    for bad in ("a[x=1", "a]x", "a[[x]"):
        with pytest.raises(SourceSpecError, match="unbalanced"):
            split_top_level(bad)


def test_values_are_typed_and_the_text_is_canonical() -> None:
    spec = parse_source_spec(" rec[size=3, rate=0.25,flag=TRUE,label=none] ", REGISTRY)
    assert spec.name == "rec" and spec.text == "rec[size=3,rate=0.25,flag=TRUE,label=none]"
    assert spec.build(REGISTRY).kwargs == dict(size=3, rate=0.25, flag=True, label=None)
    assert parse_source_spec("rec[label=abc]", REGISTRY).build(REGISTRY).kwargs["label"] == "abc"
    assert parse_source_spec("rec[]", REGISTRY).text == "rec"


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown draft source 'nope'; allowed: rec, other"),
    ("rec[size]", "'size' is not key=value"),
    ("rec[size=]", "'size=' is not key=value"),
    ("rec[1x=2]", "'1x=2' is not key=value"),
    ("rec[size=2,size=3]", "'size' is given twice"),
    ("rec[size=0]", "size must be >= 1, got 0"),
    ("rec[sise=2]", "unexpected keyword argument 'sise'"),
    ("rec[size=2]x", "expected rec\\[key=value,...\\]"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(SourceSpecError, match=message):
        parse_source_spec(spec, REGISTRY)


def test_cli_sources_accept_settings() -> None:
    specs = cli.parse_source_names("prompt, jacobi[window=3,ngram=4,max_candidates=1]")
    assert specs == ["prompt", "jacobi[window=3,ngram=4,max_candidates=1]"]
    prompt, jacobi = cli.make_sources(specs)
    assert prompt.name == "prompt" and (jacobi.window, jacobi.ngram, jacobi.max_candidates) == (3, 4, 1)
    with pytest.raises(cli.UsageError, match=r"ngram must be an int >= 3, got 2 \(in --sources\)"):
        cli.parse_source_names("jacobi[ngram=2]")
    with pytest.raises(cli.UsageError, match="listed twice"):
        cli.parse_source_names("jacobi[window=3],jacobi[ window=3 ]")
