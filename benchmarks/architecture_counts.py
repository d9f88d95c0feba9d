"""Issue 36 ("one house, second pass") before and after: sizes, repeats and the files a new
placement strategy or condition touches, measured on committed revisions.

    python3 benchmarks/architecture_counts.py [--rev aa3f41d^ --rev 997c18e^ --rev HEAD] \
        [--out benchmarks/results]

Each revision is exported with ``git archive REV | tar -x`` into a temporary folder (so what is
measured is what was committed, not the working tree), and there:

- sizes: every ``.py`` file under the product packages (``operator/moejob_operator``,
  ``operator/moe_contracts``, ``trainer_image/moe_trainer``) and the dev tooling
  (``operator/dev``): files, lines (newlines, as tests/test_architecture.py counts them), the
  files over 600 lines (and whether their module docstring has a line starting ``Size:``), the
  largest five;
- repeats: ``duplicates --repo DIR --seconds 120 --most 200`` on ``operator/`` and
  ``trainer_image/``: its first line parsed (pairs, files read, pairs by shape alone, boilerplate;
  ``--most`` changes only how many rows follow) and every row kept;
- spellings: the product files (any file in the three packages) that spell a placement
  strategy's value (``STRATEGY_PATTERN``) or the ``UpgradeVerified`` condition's name, and the
  CRD copies (``crds/``, ``charts/``) that spell them; a new strategy or condition is written in
  at least those files;
- the plan held untyped: lines of the operator outside ``core/`` that carry the plan as a dict
  (``PLAN_DICT_PATTERN``: a ``plan: dict[str, Any]`` annotation, ``plan.get(``, ``plan["``) and
  lines of the trainer that read ``plan.raw`` (the document, not the contract's type).

The first default revision is the parent of the first issue-36 commit (aa3f41d, the
moe_localkube.images split; 997c18e, the core/plan.py split, came right after it). Writes
``architecture_counts.{json,md}``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("operator/moejob_operator", "operator/moe_contracts", "trainer_image/moe_trainer")
DEV = ("operator/dev",)
LIMIT = 600
STRATEGY_PATTERN = r"topology_aware|TopologyAware|brute_force|BruteForce|round_robin|RoundRobin"
CONDITION_PATTERN = r"UpgradeVerified"
PLAN_DICT_PATTERN = r"plan: dict\[str, Any\]|\bplan\.get\(|\bplan\[\""
OPERATOR_OUTSIDE_CORE = "operator/moejob_operator"
SCHEMA = ("crds", "charts")
DUPLICATES = "duplicates"
_FIRST_LINE = re.compile(
    r"(?P<pairs>\d+) pairs? of places \((?P<files>\d+) files? read\).*?"
    r"\((?P<shape>\d+) by shape alone, (?P<boilerplate>\d+) of those marked boilerplate\)"
)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def export(rev: str, into: Path) -> None:
    archive = subprocess.Popen(["git", "archive", rev], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {rev} failed")


def python_files(tree: Path, folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for f in folders for p in (tree / f).rglob("*.py"))


def sizes(tree: Path, folders: tuple[str, ...]) -> dict:
    rows = []
    for path in python_files(tree, folders):
        text = path.read_text()
        lines = text.count("\n")
        row = {"file": str(path.relative_to(tree)), "lines": lines}
        if lines > LIMIT:
            doc = ast.get_docstring(ast.parse(text)) or ""
            row["size_line"] = bool(re.search(r"^Size:", doc, re.MULTILINE))
        rows.append(row)
    rows.sort(key=lambda r: (-r["lines"], r["file"]))
    return {
        "files": len(rows),
        "lines": sum(r["lines"] for r in rows),
        "over_limit": [r for r in rows if r["lines"] > LIMIT],
        "largest": [{"file": r["file"], "lines": r["lines"]} for r in rows[:5]],
    }


def duplicates(folder: Path) -> dict:
    out = subprocess.run(
        [DUPLICATES, "--repo", str(folder), "--seconds", "120", "--most", "200"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    first = out.splitlines()[0] if out else ""
    m = _FIRST_LINE.search(first)
    counts = {k: int(v) for k, v in m.groupdict().items()} if m else {}
    rows = out.splitlines()[1:]
    if counts:
        counts["with_an_identical_run"] = counts["pairs"] - counts["shape"]
        # the model families' modules: one per family and side, each written to one pattern
        pairs = [r for r in rows if re.match(r"D\d+ ", r)]
        families = [r for r in pairs if "/families/" in r]
        counts["with_a_families_side"] = len(families)
        counts["with_a_families_side_identical_run"] = sum(" shape" not in r for r in families)
        counts["no_families_side"] = counts["pairs"] - len(families)
        counts["no_families_side_identical_run"] = (
            counts["with_an_identical_run"] - counts["with_a_families_side_identical_run"]
        )
    return {
        "first_line": first,
        **counts,
        "incomplete": "incomplete:" in out,
        "rows": rows,
    }


def spelled(tree: Path, folders: tuple[str, ...], pattern: str) -> list[str]:
    r = subprocess.run(
        ["grep", "-rlE", "--exclude-dir=__pycache__", pattern, *folders],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    return sorted(r.stdout.split())


def matching_lines(tree: Path, folder: str, pattern: str, exclude: str | None = None) -> list[str]:
    """``file:line: text`` of every .py line under ``folder`` matching ``pattern``."""
    args = ["grep", "-rnE", "--include=*.py", "--exclude-dir=__pycache__"]
    if exclude:
        args.append(f"--exclude-dir={exclude}")
    r = subprocess.run([*args, pattern, folder], cwd=tree, capture_output=True, text=True)
    return sorted(line.strip() for line in r.stdout.splitlines())


def measure(rev: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        export(rev, tree)
        places = {
            name: {
                "product": (p := spelled(tree, PRODUCT, pattern)),
                "schema": (s := spelled(tree, SCHEMA, pattern)),
                "files": len(p) + len(s),
            }
            for name, pattern in (("strategy", STRATEGY_PATTERN), ("condition", CONDITION_PATTERN))
        }
        return {
            "rev": rev,
            "commit": git("rev-parse", "--short", rev),
            "subject": git("log", "-1", "--format=%s", rev)[:120],
            "sizes": {"product": sizes(tree, PRODUCT), "dev": sizes(tree, DEV)},
            "duplicates": {
                "operator": duplicates(tree / "operator"),
                "trainer_image": duplicates(tree / "trainer_image"),
            },
            "spelled": places,
            "untyped_plan": {
                "operator": matching_lines(
                    tree, OPERATOR_OUTSIDE_CORE, PLAN_DICT_PATTERN, exclude="core"
                ),
                "trainer": matching_lines(tree, PRODUCT[2], r"\bplan\.raw\b"),
            },
        }


def markdown(doc: dict) -> str:
    revs = doc["revisions"]
    head = "| | " + " | ".join(f"`{r['rev']}` ({r['commit']})" for r in revs) + " |"
    out = [
        "# Issue 36 before and after",
        "",
        f"`{doc['command']}`",
        "",
        head,
        "|---" * (len(revs) + 1) + "|",
    ]

    def row(label: str, get) -> None:
        out.append(f"| {label} | " + " | ".join(str(get(r)) for r in revs) + " |")

    for side in ("product", "dev"):
        row(f"{side}: .py files", lambda r, s=side: r["sizes"][s]["files"])
        row(f"{side}: lines", lambda r, s=side: r["sizes"][s]["lines"])
        row(
            f"{side}: files over {LIMIT} lines",
            lambda r, s=side: len(r["sizes"][s]["over_limit"]),
        )
    for folder in ("operator", "trainer_image"):
        keys = ("files", "pairs", "with_an_identical_run", "with_a_families_side")
        for key in (*keys, "no_families_side", "no_families_side_identical_run"):
            label = f"duplicates {folder}/: {key.replace('_', ' ')}"
            row(label, lambda r, f=folder, k=key: r["duplicates"][f].get(k))
        row(
            f"duplicates {folder}/: by shape alone (boilerplate)",
            lambda r, f=folder: (
                f"{r['duplicates'][f].get('shape')} ({r['duplicates'][f].get('boilerplate')})"
            ),
        )
    for name in ("strategy", "condition"):
        row(f"{name}: product files", lambda r, n=name: len(r["spelled"][n]["product"]))
        row(f"{name}: CRD files", lambda r, n=name: len(r["spelled"][n]["schema"]))
    for side in ("operator", "trainer"):
        row(
            f"plan held untyped: {side} lines",
            lambda r, s=side: len(r["untyped_plan"][s]) if "untyped_plan" in r else "-",
        )
    for r in revs:
        out += ["", f"## `{r['rev']}` ({r['commit']}): {r['subject']}", ""]
        for side in ("product", "dev"):
            over = r["sizes"][side]["over_limit"]
            text = ", ".join(
                f"`{o['file']}` {o['lines']}{' (Size: line)' if o['size_line'] else ''}"
                for o in over
            )
            out.append(f"- {side} over {LIMIT} lines: {text or 'none'}")
            largest = ", ".join(f"`{x['file']}` {x['lines']}" for x in r["sizes"][side]["largest"])
            out.append(f"- {side} largest: {largest}")
        for name in ("strategy", "condition"):
            files = r["spelled"][name]["product"] + r["spelled"][name]["schema"]
            out.append(f"- {name} spelled in: " + ", ".join(f"`{f}`" for f in files))
        for folder in ("operator", "trainer_image"):
            out.append(f"- duplicates `{folder}/`: {r['duplicates'][folder]['first_line']}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", help="revision to measure (repeat; in order)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    revs = args.rev or ["aa3f41d^", "997c18e^", "HEAD"]
    command = "python3 benchmarks/architecture_counts.py " + " ".join(f"--rev {r}" for r in revs)
    doc = {
        "command": command,
        "limit_lines": LIMIT,
        "product": list(PRODUCT),
        "dev": list(DEV),
        "strategy_pattern": STRATEGY_PATTERN,
        "condition_pattern": CONDITION_PATTERN,
        "plan_dict_pattern": PLAN_DICT_PATTERN,
        "schema_folders": list(SCHEMA),
        "duplicates_path": subprocess.run(
            ["sh", "-c", f"command -v {DUPLICATES}"], capture_output=True, text=True
        ).stdout.strip(),
        "revisions": [measure(rev) for rev in revs],
    }
    out = ROOT / args.out
    (out / "architecture_counts.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "architecture_counts.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
