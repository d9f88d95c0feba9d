"""The sizing's candidates for the 2 x 8 H200 examples: what ``Auto`` would choose there.

    PYTHONPATH=operator .venv/bin/python benchmarks/sizing_candidates.py --out benchmarks/results

Both examples through the operator's own path (``reconcile.planning.plan_request`` from the parsed
spec, then ``core.sizing.plan_sized``) on two discovered HGX H200 nodes (the ``nvswitch-h200-8``
fixture, one per node): ``examples/gpu-h200.yaml`` with its sizing fields set to ``Auto`` (the
tiny model of that example) and ``examples/gpu-h200-auto.yaml`` (Mixtral 8x7B). Predictions only:
no multi-node run was measured; the only multi-GPU measurements behind the model are the 2-GPU
runs (``multigpu_h200x2_run*``, docs/planning.md "Sizing"). Writes
``OUT/sizing_candidates_h200x2x8.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from moejob_operator.builders.common import JobRef
from moejob_operator.core.sizing import plan_sized
from moejob_operator.core.sizing_text import sizing_table
from moejob_operator.core.topology import load_topology
from moejob_operator.reconcile import planning, sizing
from moejob_operator.spec import parse_spec

NODES = ("gpu-a", "gpu-b")
AUTO = {
    "nodes": {"count": "Auto", "gpusPerNode": "Auto"},
    "training": {"microBatch": "Auto", "activationCheckpointing": "Auto"},
    "placement": {"expertParallelSize": "Auto"},
}


def spec_of(example: str, auto: bool) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    if auto:
        for group, values in AUTO.items():
            raw[group] = {**raw.get(group, {}), **values}
        raw["placement"].pop("routingStatsFrom", None)  # no earlier job here: uniform routing
    return raw


def size(example: str, auto: bool) -> dict:
    spec = parse_spec(spec_of(example, auto))
    reports = {n: load_topology("nvswitch-h200-8").model_copy(update={"node": n}) for n in NODES}
    job = JobRef(namespace="default", name=Path(example).stem, uid="example")
    req = planning.plan_request(job, spec, list(NODES), reports, None, 0)
    plan = plan_sized(req, sizing.auto_fields(spec))
    rec = plan.document["sizing"]
    return {
        "example": example,
        "model": spec.model.preset,
        "seqLen": spec.training.seq_len,
        "globalBatch": spec.training.global_batch,
        "nodes": list(NODES),
        "gpu": plan.gpu.name,
        "sizing": rec,
        "table": sizing_table(rec, plan.gpu.name),
    }


def markdown(results: list[dict]) -> str:
    lines = [
        "# Sizing candidates on 2 x 8 H200 (predictions)",
        "",
        (
            "Command: `PYTHONPATH=operator .venv/bin/python benchmarks/sizing_candidates.py "
            "--out benchmarks/results`. Two nodes of the `nvswitch-h200-8` fixture; the examples' "
            "sizing fields `Auto`. No multi-node run measured these: the throughput model's only "
            "multi-GPU check is the 2-GPU runs in benchmarks/results/sizing_calibration.md."
        ),
    ]
    for r in results:
        ch, rec = r["sizing"]["chosen"], r["sizing"]
        lines += [
            "",
            f"## {r['example']}: {r['model']}, seq {r['seqLen']}, global batch {r['globalBatch']}",
            "",
            (
                f"Chosen: {ch['nodeCount']} node(s) x {ch['gpusPerNode']} GPU(s), EP "
                f"{ch['expertParallelSize']}, micro-batch {ch['microBatch']}, activation "
                f"checkpointing {'on' if ch['activationCheckpointing'] else 'off'}, persistence "
                f"{ch['persistence']}: predicted {rec['predictedTokensPerSecond']:,.0f} tokens/s, "
                f"{rec['predictedPeakBytes'] / 2**30:.1f} GiB per GPU "
                f"({rec['candidatesConsidered']} shapes considered)."
            ),
            "",
            "```",
            r["table"],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    results = [size("gpu-h200.yaml", auto=True), size("gpu-h200-auto.yaml", auto=False)]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sizing_candidates_h200x2x8.json").write_text(json.dumps(results, indent=1) + "\n")
    (a.out / "sizing_candidates_h200x2x8.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
