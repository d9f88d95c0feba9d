"""Every throughput figure in README.md and docs/*.md says the shape it was measured at (issue 37).

A tokens/s or MFU figure means nothing without its shape: 91.7k tokens/s at seq 1024 x
micro-batch 16 and 89.7k at seq 2048 x 8 are different claims about the same model. The rule,
per block as ``tests/test_docs_numbers.py`` cuts them (a paragraph, a list item, or a table with
the paragraph right before it as its caption; fenced code is not checked): a block that states a
throughput figure (a number followed by ``tokens/s`` or ``tok/s``, a percentage next to ``MFU``,
a speed-up against a baseline such as ``1.96x stock``, or a table whose header has a ``tokens/s`` or ``MFU`` column) also names

* the sequence length (``seq 2048``, ``sequence length 2048``) and the micro-batch
  (``micro-batch 8``, ``seq 2048 x 8``), code spans included;
* the device it ran on (``H200``, ``CPU`` or ``GPU``);
* the result file under ``benchmarks/results/`` the figure comes from (whose numbers
  ``test_docs_numbers.py`` then checks).

The model, precision and step count are stated beside the figures too (docs/benchmarks.md), but
their spellings vary too much for a check that stays honest; the three above are what the two
offenders of issue 37 (the README's user-flow figure and MFU claims) lacked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs_numbers import DOCS, ROOT, _prose, blocks

_RATE = re.compile(r"\d[\d,.]*\s*k?\s*(?:tokens|tok)/s\b")
_MFU = re.compile(r"\d+(?:\.\d+)?\s*%\s*MFU\b|\bMFU\b[^.;|]{0,40}?\d+(?:\.\d+)?\s*%")
# a speed ratio against a baseline measured in the same run: "1.96x stock", "0.82x compiled plain"
_SPEEDUP = re.compile(r"\d+(?:\.\d+)?x\s+(?:stock|compiled|plain PyTorch|the direct call)\b")
_SEQ = re.compile(r"\bseq(?:uence)?(?:[ _-]?len(?:gth)?)?\s*(?:of\s*)?\d+", re.IGNORECASE)
_MICRO = re.compile(
    r"micro[- ]?batch(?:es)?\s*(?:of\s*|size\s*)?\d+"
    r"|\bseq(?:uence)?(?:[ _-]?len(?:gth)?)?\s*\d+\s*x\s*\d+",
    re.IGNORECASE,
)
_DEVICE = re.compile(r"\b(?:H200s?|CPU|GPUs?)\b")
_RESULT = re.compile(r"benchmarks/results/\S")


def _table_states_rate(text: str) -> bool:
    """A table whose header row has a tokens/s or MFU column and at least one body row."""
    rows = [ln for ln in text.splitlines() if ln.lstrip().startswith("|")]
    if len(rows) < 3:
        return False
    header = rows[0].lower()
    return "tokens/s" in header or "tok/s" in header or re.search(r"\bmfu\b", header) is not None


def states_throughput(text: str) -> bool:
    prose = _prose(text)
    return bool(_RATE.search(prose) or _MFU.search(prose) or _SPEEDUP.search(prose)) or _table_states_rate(prose)


def missing_shape(text: str) -> list[str]:
    """What a block with a throughput figure does not name (empty if it names all of it)."""
    if not states_throughput(text):
        return []
    plain = text.replace("`", "")  # shapes are often written as `seq 2048`
    checks = [
        ("sequence length", _SEQ),
        ("micro-batch", _MICRO),
        ("device", _DEVICE),
        ("result file", _RESULT),
    ]
    return [name for name, rx in checks if not rx.search(plain)]


def check(doc: Path) -> list[str]:
    rel = doc.relative_to(ROOT)
    out = []
    for line, _section, text in blocks(doc.read_text()):
        missing = missing_shape(text)
        if missing:
            first = text.strip().splitlines()[0][:70]
            out.append(f"{rel}:{line}: throughput figure without {', '.join(missing)}: {first!r}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_throughput_figure_states_its_shape(doc):
    problems = check(doc)
    assert not problems, "\n".join(problems)


def test_the_rule_catches_the_offenders_of_issue_37():
    # the README's user-flow paragraph and MFU claim as they read before issue 37
    userflow = (
        "The same path with the `bench-mixtral-3b` model (`bash benchmarks/userflow_gpu.sh OUT "
        "bench-mixtral-3b 40`): every stage exited 0, median 91,749 tokens/s after step 10 "
        "(`benchmarks/results/userflow_h200_3b.json`)."
    )
    assert missing_shape(userflow) == ["sequence length", "micro-batch", "device"]
    mfu_claim = (
        "Both goals are met on the larger model (`benchmarks/results/mfu_h200_run9.md`) on one "
        "H200: 41.4% MFU, 0.82x compiled plain PyTorch."
    )
    assert missing_shape(mfu_claim) == ["sequence length", "micro-batch"]
    table = "Runs on CPU (`benchmarks/results/x.json`):\n\n| variant | tok/s |\n|---|---|\n| a | 9 |"
    assert missing_shape(table) == ["sequence length", "micro-batch"]
    # the same blocks with their shapes pass
    assert missing_shape(userflow + " One H200, bf16, seq 1024 x micro-batch 16.") == []
    assert missing_shape(mfu_claim + " (seq 2048, micro-batch 8)") == []
    # words alone are no figure: a list of what the operator reports states no throughput
    assert not states_throughput("reports conditions, progress (step, loss, tokens/s, ETA)")
    assert not states_throughput("the MFU goal of the issue")
    assert states_throughput("MFU 41.4%") and states_throughput("at 246.4k tok/s")
