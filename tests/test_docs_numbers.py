"""Every measured number in README.md and docs/*.md is in the committed result file it cites.

The convention (docs/benchmarks.md says it for people adding numbers):

* A *block* is a paragraph, a list item or a table, together with the paragraph right before a
  table (the table's caption). Fenced code blocks (transcripts, commands) are not checked.
* A block that names a file under ``benchmarks/results/`` (``operator.{json,md}`` and
  ``run{1,2,3}`` brace forms included) cites it: every number in that block's prose must appear
  in one of the cited files, at the precision written (``163.2k`` matches 163214.7, ``9%``
  matches 9.1 or 0.091, ``0.52`` matches 0.5213). Numbers in `code spans`, link targets and
  words (``H200``, ``top-8``, ``ZeRO-3``, ``v1.20.2``) are not figures and are skipped.
* In the README's "Measured numbers" section every block with a figure must cite a file, so a
  new number there without its result file fails.

The numbers a figure is compared with are all the numbers in the cited files' text (JSON and
Markdown alike), so a benchmark that writes its Markdown table from its JSON is enough, plus the
total of every JSON object whose values are all numbers (``{"InvalidSpec": 40, "Other": 3}``
backs a "43").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MEASURED_SECTION = "## Measured numbers"

_CITE = re.compile(r"benchmarks/results/[\w.{},\-*/]+")
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_FILE_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_FILE_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 116,840 in a Markdown table


def _expand(cite: str) -> list[str]:
    """``a.{json,md}`` -> [a.json, a.md]; ``run{1,2}`` likewise; trailing punctuation dropped."""
    cite = cite.rstrip(".,)")
    parts = re.split(r"(\{[^}]*\})", cite)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_files(text: str) -> list[str]:
    out = []
    for m in _CITE.finditer(text):
        for name in _expand(m.group(0)):
            if "*" in name:
                out.extend(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob(name)))
            elif name.rstrip("/") != RESULTS.rstrip("/"):
                out.append(name)
    return out


def _prose(text: str) -> str:
    """The block without code spans, link targets, image links and HTML comments."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(text: str) -> list[tuple[str, float, int, str]]:
    """(as written, value, decimals, unit) for each figure in a block's prose: a number not glued
    to a word (H200, top-8, ZeRO-3, v1.20.2, p50, 8x7b), with an optional unit k, M, % or x."""
    prose, out = _prose(text), []
    for m in _NUMBER.finditer(prose):
        b1 = prose[m.start() - 1] if m.start() >= 1 else " "
        b2 = prose[m.start() - 2] if m.start() >= 2 else " "
        if b1.isalnum() or b1 in "._/" or (b1 == "-" and b2.isalpha()):
            continue
        num, end = m.group(0), m.end()
        unit = prose[end] if end < len(prose) and prose[end] in "kM%x" else ""
        a1 = prose[end + len(unit)] if end + len(unit) < len(prose) else " "
        a2 = prose[end + len(unit) + 1] if end + len(unit) + 1 < len(prose) else " "
        if a1.isalnum() or a1 == "_" or (a1 == "." and a2.isdigit()):
            continue
        num_plain = num.replace(",", "")
        decimals = len(num_plain.split(".")[1]) if "." in num_plain else 0
        out.append((num + unit, float(num_plain), decimals, unit))
    return out


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, section heading, block text): paragraphs, list items, tables with captions."""
    out, cur, start, section, fenced = [], [], 0, "", False
    lines = text.splitlines()

    def flush():
        if cur:
            out.append((start, section, "\n".join(cur)))
        cur.clear()

    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            flush()
            section = line.strip()
            continue
        if not line.strip():
            flush()
            continue
        is_table = line.lstrip().startswith("|")
        if cur and (
            re.match(r"\s*(?:[-*]|\d+\.) ", line)
            or (is_table != cur[-1].lstrip().startswith("|") and not is_table)
        ):
            flush()  # a new list item; prose after a table
        if not cur:
            start = i
        cur.append(line)
    flush()
    # a table belongs with the paragraph right before it (its caption and command)
    merged: list[tuple[int, str, str]] = []
    for b in out:
        if (
            merged
            and b[2].lstrip().startswith("|")
            and not merged[-1][2].lstrip().startswith("|")
            and merged[-1][1] == b[1]
            and "|" not in merged[-1][2].splitlines()[-1][:1]
        ):
            prev = merged.pop()
            b = (prev[0], prev[1], prev[2] + "\n" + b[2])
        merged.append(b)
    return merged


def _totals(doc) -> list[float]:
    """The sum of every JSON object whose values are all numbers (a breakdown's total)."""
    out = []
    if isinstance(doc, dict):
        values = list(doc.values())
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out.append(float(sum(values)))
        for v in values:
            out += _totals(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _totals(v)
    return out


def _file_numbers(path: Path) -> list[float]:
    text = path.read_text(errors="replace")
    numbers = [abs(float(x)) for x in _FILE_NUMBER.findall(text)] + [
        float(x.replace(",", "")) for x in _FILE_THOUSANDS.findall(text)
    ]
    if path.suffix == ".json":
        with contextlib.suppress(ValueError):
            numbers += [abs(t) for t in _totals(json.loads(text))]
    return numbers


def found(value: float, decimals: int, unit: str, numbers: list[float]) -> bool:
    tol = 0.5 * 10**-decimals + 1e-9
    scales = {"k": [1e3], "M": [1e6], "%": [1.0, 0.01], "x": [1.0], "": [1.0, 1e3, 1e-3]}[unit]
    return any(abs(n / s - value) <= tol for s in scales for n in numbers)


def check(doc: Path) -> list[str]:
    problems = []
    rel = doc.relative_to(ROOT)
    for line, section, text in blocks(doc.read_text()):
        cites = cited_files(text)
        figs = figures(text)
        if not cites:
            if doc.name == "README.md" and section == MEASURED_SECTION and figs:
                problems.append(
                    f"{rel}:{line}: figures {[f[0] for f in figs][:6]} cite no file under {RESULTS}"
                )
            continue
        missing = [c for c in cites if not (ROOT / c).is_file()]
        if missing:
            problems.append(f"{rel}:{line}: cites missing result file(s) {missing}")
            continue
        numbers = [n for c in cites for n in _file_numbers(ROOT / c)]
        absent = [f[0] for f in figs if not found(f[1], f[2], f[3], numbers)]
        if absent:
            problems.append(f"{rel}:{line}: not in {sorted(set(cites))}: {absent}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_figure_is_in_the_result_file_it_cites(doc):
    problems = check(doc)
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_wrong_figure_and_a_missing_file(tmp_path):
    ok = "Run (`benchmarks/results/operator.json`): 100 jobs"
    assert figures(ok) == [("100", 100.0, 0, "")]
    assert cited_files("`benchmarks/results/trainer_h200.{json,md}`") == [
        "benchmarks/results/trainer_h200.json",
        "benchmarks/results/trainer_h200.md",
    ]
    assert [
        f[0] for f in figures("H200, top-8, ZeRO-3, v1.20.2, p50 of 163.2k and 9% or 1.9x")
    ] == ["163.2k", "9%", "1.9x"]
    assert found(163.2, 1, "k", [163214.7]) and not found(163.2, 1, "k", [163300.0])
    assert (
        found(9, 0, "%", [0.091])
        and found(0.52, 2, "", [0.5213])
        and not found(0.52, 2, "", [0.53])
    )
    assert _totals({"refused": {"InvalidSpec": 40, "Other": 3}, "n": [1, True]}) == [43.0]
    doc = tmp_path / "README.md"
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"p50": 0.5213, "jobs": 100}')
    doc.write_text(
        "## Measured numbers\nOperator (`benchmarks/results/r.json`): 100 jobs, p50 0.52 s, p99 "
        "0.61 s\n\n"
        "Another claim: 42 s\n\nGone (`benchmarks/results/nope.json`): 1 s\n"
    )
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        problems = check(doc)
    finally:
        ROOT = old
    assert len(problems) == 3, problems
    assert (
        "['0.61']" in problems[0] and "cite no file" in problems[1] and "nope.json" in problems[2]
    )
