"""The GPU measurement scripts (``benchmarks/*.sh``) say only what their commands accept.

They run where a device is at hand for minutes at a time, far from this suite: a renamed option
or a method name the bench no longer knows would cost that whole run. So, read statically (no
script runs here): every shell script parses (``bash -n``); every option a script passes to
``specdraft bench`` or to a script under ``benchmarks/`` is one that command defines; every
method list it passes (literal, or a variable's default) is one the bench accepts.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from specdraft.bench.methods import parse_methods

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "scripts").glob("*.sh")])
GPU_SCRIPTS = [p for p in SCRIPTS if p.parent.name == "benchmarks"]

#: where the options of ``python -m specdraft bench`` are defined
BENCH_SOURCES = [ROOT / "specdraft" / "cli.py", *sorted((ROOT / "specdraft" / "bench").glob("*.py"))]
#: a command ends at a pipe, a redirection or a list operator
_COMMAND_END = re.compile(r"\s(?:\||>|2>|&&|\|\||;)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_DEFAULT = re.compile(r"^\$\{\w+:-(.*)\}$")


def _logical_lines(path: Path) -> list[str]:
    """The script's lines with ``\\`` continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.split(" # ")[0] if not raw.lstrip().startswith("#") else ""
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return lines


def _invocations(path: Path) -> list[tuple[str, str]]:
    """Each ``(target, arguments)`` a script runs: ``bench`` for ``-m specdraft bench`` (with the
    ``common`` array's options where it is spliced in), else the path of a benchmarks script."""
    lines = _logical_lines(path)
    common = next((m.group(1) for line in lines if (m := re.search(r"\bcommon=\((.*)\)", line))), "")
    found = []
    for line in lines:
        for match in re.finditer(r'"\$PY" (-m specdraft bench|benchmarks/[\w]+\.py)(.*)', line):
            arguments = _COMMAND_END.split(match.group(2))[0]
            if "${common[@]}" in arguments:
                arguments += " " + common
            target = "bench" if match.group(1).startswith("-m") else match.group(1)
            found.append((target, arguments))
    return found


def _defined_options(target: str) -> str:
    sources = BENCH_SOURCES if target == "bench" else [ROOT / target]
    return "\n".join(p.read_text() for p in sources)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_shell_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_every_option_a_script_passes_is_defined_by_its_command(script: Path) -> None:
    for target, arguments in _invocations(script):
        defined = _defined_options(target)
        unknown = [o for o in _OPTION.findall(arguments) if f'"{o}"' not in defined]
        assert not unknown, f"{script.name} passes {unknown} to {target}, which does not define them"


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_every_method_list_a_script_passes_is_one_the_bench_accepts(script: Path) -> None:
    lists = []
    for target, arguments in _invocations(script):
        words = shlex.split(arguments)
        for flag, value in zip(words, words[1:]):
            if target == "bench" and flag == "--methods":
                default = _DEFAULT.match(value)
                if default or "$" not in value:
                    lists.append(default.group(1) if default else value)
    for line in _logical_lines(script):  # a list assigned to a variable first (gpu_run.sh's methods=...)
        if (m := re.match(r"\s*methods=([\w@+,.\[\]=-]+)\s*$", line)):
            lists.append(m.group(1))
    for methods in lists:
        parse_methods(methods)  # raises MethodError naming a method the bench does not know


def test_the_checks_see_the_gpu_runs_commands() -> None:
    """The reading above finds what it should (so the checks cannot pass by finding nothing)."""
    pieces = _invocations(ROOT / "benchmarks" / "gpu_pieces.sh")
    assert sum(target == "bench" for target, _ in pieces) >= 7
    assert "benchmarks/host_critical_path.py" in {target for target, _ in pieces}
    main = next(arguments for target, arguments in pieces
                if target == "bench" and "--dataset humaneval,mtbench" in arguments)
    assert "--no-plot" in main and "--methods" in main
    with pytest.raises(ValueError):
        parse_methods("plain,no-such-method")
