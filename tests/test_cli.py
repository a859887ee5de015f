"""The ``specdraft`` command line: argument errors exit 2 with a message and no traceback, the
source registry, the plain-decoding timer, and (once the decoder exists) a full run on a tiny model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specdraft import cli
from specdraft.cli import SOURCES, UsageError, main, parse_source_names
from specdraft.kernels.fp16_linear import fbgemm_problem
from specdraft.sources.registry import DEFAULT_SOURCES


# offline_cache: no test here may reach the hub or write to the real user cache (see conftest.py)
pytestmark = pytest.mark.usefixtures("offline_cache")






def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


# ---------------------------------------------------------------------------------- sources


def test_prompt_source_is_registered() -> None:
    assert "prompt" in SOURCES
    assert parse_source_names(" prompt ,") == ["prompt"]


@pytest.mark.parametrize("text, message", [
    ("prompt,bogus", "unknown draft source 'bogus'"),
    ("", "at least one draft source"),
    ("prompt,prompt", "listed twice"),
])
def test_bad_source_lists_are_rejected(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_source_names(text)


def test_registry_builds_a_draft_source() -> None:
    source = cli.make_sources(["prompt"])[0]
    assert source.name == "prompt"


def test_unknown_source_exits_2_before_loading_the_model(capsys, monkeypatch) -> None:
    monkeypatch.setattr("specdraft.models.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, out, err = run(capsys, "generate", "--model", "/no/such/model", "--prompt", "x", "--sources", "prompt,jacobi2")
    assert_usage_error(code, err, "unknown draft source 'jacobi2'", "allowed: prompt")
    assert out == ""


# ---------------------------------------------------------------------------------- arguments


def test_missing_model_path_exits_2_without_traceback(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nowhere" / "model"), "--prompt", "x")
    assert_usage_error(code, err, "does not exist")


def test_missing_gguf_exits_2(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "x")
    assert_usage_error(code, err, "GGUF file not found")


def test_unknown_model_name_lists_aliases(capsys) -> None:
    code, _, err = run(capsys, "generate", "--model", "no-such-model-xyz", "--prompt", "x", "-q")
    assert_usage_error(code, err, "no-such-model-xyz", "smollm2-135m", "qwen2.5-coder-0.5b")


def test_sampling_options_need_sample(capsys) -> None:
    code, _, err = run(capsys, "generate", "--prompt", "x", "--temperature", "0.7", "--top-k", "5")
    assert_usage_error(code, err, "--temperature, --top-k only apply to sampling; add --sample")


def test_missing_prompt_file_exits_2(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--prompt-file", str(tmp_path / "absent.txt"))
    assert_usage_error(code, err, "cannot read --prompt-file")


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--max-new-tokens", "0"], "must be >= 1"),
    (["generate", "--max-tree-nodes", "-1"], "must be >= 0"),
    (["generate", "--threads", "two"], "expected an integer"),
    (["generate", "--top-p", "1.5"], "must be in (0, 1]"),
    (["generate", "--temperature", "0"], "must be a finite number > 0"),
    (["generate", "--dtype", "int8"], "invalid choice"),
    (["generate", "--prompt", "a", "--prompt-file", "f"], "not allowed with argument"),
    (["frobnicate"], "invalid choice"),
])
def test_argparse_errors_exit_2(capsys, argv: list[str], fragment: str) -> None:
    code, _, err = run(capsys, *argv)
    assert_usage_error(code, err, fragment)


def test_no_command_prints_help_and_exits_2(capsys) -> None:
    code, _, err = run(capsys)
    assert code == 2 and "generate" in err


def test_help_exits_0(capsys) -> None:
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0 and "--max-tree-nodes" in out and "--compare" in out


# ---------------------------------------------------------------------------------- baseline


def test_time_plain_generate_returns_new_tokens_only(tiny_dir: Path) -> None:
    import torch

    from specdraft.baseline import time_plain_generate, warmup_forward
    from specdraft.models import load_model

    model, tokenizer = load_model(str(tiny_dir), dtype="float64", progress=False)
    prompt = tokenizer("a b c a b")["input_ids"]
    warmup_forward(model, prompt)
    ids, seconds = time_plain_generate(model, prompt, 6, do_sample=False)
    assert seconds > 0 and 1 <= len(ids) <= 6 and all(isinstance(t, int) for t in ids)
    full = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert ids == full[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------- end to end



def test_generate_json_compare_on_tiny_model(capsys, tiny_dir: Path) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a b c d a b c d a b",
                         "--max-new-tokens", "12", "--dtype", "float64", "--compare", "--json", "-q")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert 1 <= record["new_tokens"] <= 12 and record["steps"] >= 1
    assert set(record["per_source"]) == set(DEFAULT_SOURCES)
    assert record["compare"]["identical"] is True
    assert record["token_ids"] and isinstance(record["text"], str)


def test_generate_compare_line_on_tiny_model(capsys, tiny_dir: Path) -> None:
    """Without --json, --compare's verdict is one line on stderr, after the text on stdout."""
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a b c d a b c d a b",
                         "--max-new-tokens", "12", "--dtype", "float64", "--compare", "-q")
    assert code == 0, err
    assert out.strip()
    assert re.search(r"plain generate \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\); speedup [\d.]+x; "
                     r"greedy output token-identical: yes", err), err


def test_generate_with_packed_cpu_kernels(capsys, tiny_dir: Path) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a b c d a b c d a b",
                         "--max-new-tokens", "12", "--dtype", "float32", "--cpu-kernels", "packed", "--compare",
                         "--json", "-q")
    assert code == 0, err
    assert json.loads(out.strip())["compare"]["identical"] is True
    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a", "--cpu-kernels", "fast")
    assert code == 2 and "'fast'" in err and "packed" in err


@pytest.mark.skipif(fbgemm_problem() is not None, reason=f"FBGEMM cannot run here: {fbgemm_problem()}")
def test_generate_with_fbgemm_cpu_kernels(capsys, tiny_dir: Path) -> None:
    """bfloat16 weights are float16 numbers: the FBGEMM path runs; the tiny float32 checkpoint's
    random weights are not, and the refusal says what would work (exit 2, no traceback)."""
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a b c d a b c d a b",
                         "--max-new-tokens", "12", "--dtype", "bfloat16", "--cpu-kernels", "fbgemm", "--json", "-q")
    assert code == 0, err
    assert 1 <= json.loads(out.strip())["new_tokens"] <= 12
    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a", "--dtype", "float32",
                       "--cpu-kernels", "fbgemm")
    assert code == 2 and "float16 holds exactly" in err and "bfloat16" in err and "Traceback" not in err


def test_generate_text_chat_and_sampling_on_tiny_model(capsys, tiny_dir: Path) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a b a b", "--chat",
                         "--max-new-tokens", "5", "--sample", "--temperature", "0.9", "--top-k", "20", "--seed", "1",
                         "--compare", "-q")
    assert code == 0, err
    assert "tokens" in err and "steps" in err and "tokens/s" in err and "speedup" in err
    assert out.endswith("\n")


def test_demo_runs_on_a_tiny_model(capsys, tiny_dir: Path) -> None:
    """The README's main job, end to end on a tiny checkpoint (the real one is the slow suite's)."""
    code, out, err = run(capsys, "demo", "--model", str(tiny_dir), "--dtype", "float64", "--max-new-tokens", "10",
                         "--repeats", "1", "-q")
    assert code == 0, err
    assert "specdraft demo:" in err and "tokens/s" in err
    assert err.count("identical to plain: yes") == 2  # transformers' prompt lookup and ours
