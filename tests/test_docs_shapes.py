"""Every throughput figure in README.md and docs/*.md says the shape it was measured at (issue 37).

A tokens/s or MFU figure means nothing without its shape: the same model's tokens/s at seq 1024 x
micro-batch 16 and at seq 2048 x 8 are different claims. The rule,
per block as ``tests/test_docs_numbers.py`` cuts them (a paragraph, a list item, or a table with
the paragraph right before it as its caption; fenced code is not checked): a block that states a
throughput figure (a number followed by ``tokens/s`` or ``tok/s``, a percentage next to ``MFU``,
a speed-up against a baseline such as ``1.96x stock``, or a table whose header has a
``tokens/s`` or ``MFU`` column) also names

* the sequence length (``seq 2048``, ``sequence length 2048``) and the micro-batch
  (``micro-batch 8``, ``seq 2048 x 8``), code spans included;
* the device it ran on (``H200``, ``CPU`` or ``GPU``);
* the result file under ``benchmarks/results/`` the figure comes from (whose numbers
  ``test_docs_numbers.py`` then checks).

And a shape a block names must be one its cited result files record (``"seqLen": 2048``,
``seq 1024``, ``micro 16``, ``microBatch 4``; an MFU run's ``"size": "3b"`` through
``benchmarks/mfu_report.py``'s ``SIZES``), where they record any: a figure measured at
seq 1024 x 16 cannot be written down as seq 2048 x 8.

The model, precision and step count are stated beside the figures too (docs/benchmarks.md), but
their spellings vary too much for a check that stays honest; the shape, device and file are what
the two offenders of issue 37 (the README's user-flow figure and MFU claims) lacked. The check is
per block: a block with figures at two shapes passes when it names both.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_docs_numbers import DOCS, ROOT, _prose, blocks, cited_files

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
    return bool(
        _RATE.search(prose) or _MFU.search(prose) or _SPEEDUP.search(prose)
    ) or _table_states_rate(prose)


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


# how result files record a shape: JSON keys, their Markdown/plan printouts, an MFU run's size
_FILE_SEQ = [r'"seq(?:Len|_len)?":\s*(\d+)', r"\bseq(?:uence)?(?: length)?\s+(\d+)"]
_FILE_MICRO = [
    r'"(?:microBatch|micro_batch|batch)":\s*(\d+)',
    r"micro[- ]?batch\s+(\d+)",
    r"\bmicro\s+(\d+)",
    r"\bmb\s+(\d+)",
]
_DOC_SEQ = re.compile(r"\bseq(?:uence)?(?:[ _-]?len(?:gth)?)?\s*(\d+)", re.IGNORECASE)
_DOC_MICRO = re.compile(
    r"micro[- ]?batch(?:es)?\s*(\d+)|\bseq(?:uence)?\s*\d+\s*x\s*(\d+)", re.IGNORECASE
)


def mfu_sizes() -> dict[str, tuple[int, int]]:
    """size -> (seq, micro-batch) from benchmarks/mfu_report.py's SIZES, which fixes the shape of
    every MFU run (its result files record only the size name)."""
    src = (ROOT / "benchmarks" / "mfu_report.py").read_text()
    rows = re.findall(r'"(\w+)": \("[\w.-]+", (\d+), (\d+)\)', src)
    return {name: (int(seq), int(micro)) for name, seq, micro in rows}


def recorded_shapes(files: list[str]) -> tuple[set[int], set[int]]:
    """The sequence lengths and micro-batches the result files record."""
    seqs: set[int] = set()
    micros: set[int] = set()
    sizes = mfu_sizes()
    for name in files:
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for rx in _FILE_SEQ:
            seqs.update(int(v) for v in re.findall(rx, text, re.IGNORECASE))
        for rx in _FILE_MICRO:
            micros.update(int(v) for v in re.findall(rx, text, re.IGNORECASE))
        for size in re.findall(r'"size":\s*"(\w+)"', text):
            if size in sizes:
                seqs.add(sizes[size][0])
                micros.add(sizes[size][1])
    return seqs, micros


def wrong_shape(text: str) -> list[str]:
    """Shapes a block names that none of its cited result files records (where they record one)."""
    seqs, micros = recorded_shapes(cited_files(text))
    plain = text.replace("`", "")
    out = []
    if seqs:
        out += [f"seq {v}" for v in sorted({int(m) for m in _DOC_SEQ.findall(plain)} - seqs)]
    if micros:
        named = {int(a or b) for a, b in _DOC_MICRO.findall(plain)}
        out += [f"micro-batch {v}" for v in sorted(named - micros)]
    return out


def check(doc: Path) -> list[str]:
    rel = doc.relative_to(ROOT)
    out = []
    for line, _section, text in blocks(doc.read_text()):
        first = text.strip().splitlines()[0][:70]
        missing = missing_shape(text)
        if missing:
            out.append(f"{rel}:{line}: throughput figure without {', '.join(missing)}: {first!r}")
        wrong = wrong_shape(text)
        if wrong:
            out.append(f"{rel}:{line}: {wrong} recorded in none of its result files: {first!r}")
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
    table = (
        "Runs on CPU (`benchmarks/results/x.json`):\n\n| variant | tok/s |\n|---|---|\n| a | 9 |"
    )
    assert missing_shape(table) == ["sequence length", "micro-batch"]
    # the same blocks with their shapes pass
    assert missing_shape(userflow + " One H200, bf16, seq 1024 x micro-batch 16.") == []
    assert missing_shape(mfu_claim + " (seq 2048, micro-batch 8)") == []
    # words alone are no figure: a list of what the operator reports states no throughput
    assert not states_throughput("reports conditions, progress (step, loss, tokens/s, ETA)")
    assert not states_throughput("the MFU goal of the issue")
    assert states_throughput("MFU 41.4%") and states_throughput("at 246.4k tok/s")


def test_a_shape_the_result_file_does_not_record_is_caught():
    # the user-flow figure read as if it ran at the MFU runs' shape: its plan printout says
    # "batch global 16 = micro 16 x accum 1 x 1, seq 1024"
    plan = "`benchmarks/results/userflow_h200_3b_plan.txt`"
    assert wrong_shape(f"One H200 ({plan}): 91,749 tokens/s at seq 2048 x micro-batch 8") == [
        "seq 2048",
        "micro-batch 8",
    ]
    assert wrong_shape(f"One H200 ({plan}): 91,749 tokens/s at seq 1024 x micro-batch 16") == []
    # an MFU result file records only its runs' sizes; mfu_report.SIZES gives their shapes
    assert mfu_sizes()["3b"] == (2048, 8) and mfu_sizes()["430m"] == (1024, 16)
    run9 = "`benchmarks/results/mfu_h200_run9.json`"
    assert wrong_shape(f"{run9}: 89,662 tokens/s at `seq 2048 x micro-batch 8`") == []
    assert wrong_shape(f"{run9}: 89,662 tokens/s at seq 4096, micro-batch 2") == [
        "seq 4096",
        "micro-batch 2",
    ]
    # a file that records no shape cannot contradict one (the block is then only checked for
    # naming one)
    assert recorded_shapes(["benchmarks/results/operator.json"]) == (set(), set())
