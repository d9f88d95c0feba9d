"""Your model and your data through the real operator (API server, node agent, operator):
a model directory on a volume is inspected before planning and planned from its report; JSONL and
Parquet data are prepared once by a data-prepare pod and reused by the next job; every bad model
or data set ends Failed with its reason, a message naming the field and an Event, and no worker
pod; a model directory changed after planning is refused before the launch."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from finetune_fixtures import (
    chats,
    make_model,
    make_tokenizer,
    sentences,
    write_jsonl,
    write_parquet,
)
from moe_localkube.testing import WaitTimeout
from moejob_operator import constants as C
from operator_harness import (
    apply_job,
    condition,
    events_for,
    example,
    get_job,
    module_namespace,
    module_operator,
    seed_topology,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

operator_proc = module_operator("operator-finetune")
ns = module_namespace("moe-ft")


@pytest.fixture(scope="module")
def work(tmp_path_factory, kube, ns):
    seed_topology(kube, ns)
    root = tmp_path_factory.mktemp("ft")
    make_model(root / "model")
    return root


def job(name: str, root, **spec) -> dict:
    base = {
        "image": "moe-trainer:local",
        "device": "CPU",
        "model": {"preset": "tiny-mixtral"},
        "checkpoint": {"everySteps": 5, "volume": {"hostPath": {"path": str(root / "ck")}}},
        "nodes": {"count": 1, "gpusPerNode": 1},
        "training": {
            "steps": 3,
            "seqLen": 32,
            "globalBatch": 2,
            "microBatch": 2,
            "learningRate": "1e-3",
        },
        "runPolicy": {"backoffLimit": 0},
        "gate": {"skip": True, "skipReason": "test: the gate has its own tests"},
    }
    base.update(spec)
    return {
        "apiVersion": f"{C.GROUP}/{C.VERSION}",
        "kind": C.KIND,
        "metadata": {"name": name},
        "spec": base,
    }


def model_from(path) -> dict:
    return {"path": "/model", "volume": {"hostPath": {"path": str(path)}}}


def workers(kube, ns, name) -> list:
    sel = f"{C.LABEL_JOB}={name},{C.LABEL_COMPONENT}=worker"
    return kube.core.list_namespaced_pod(ns, label_selector=sel).items


def wait_done(kube, ns, names, wait_for, operator_proc, timeout=600):
    def done():
        return all(
            condition(get_job(kube, ns, n), C.COND_FAILED).get("status") == "True"
            or condition(get_job(kube, ns, n), C.COND_SUCCEEDED).get("status") == "True"
            for n in names
        )

    try:
        wait_for(done, timeout=timeout, message="jobs finished")
    except WaitTimeout:
        states = {n: (get_job(kube, ns, n).get("status") or {}).get("conditions") for n in names}
        pods = [(p.metadata.name, p.status.phase) for p in kube.core.list_namespaced_pod(ns).items]
        raise AssertionError(
            f"jobs not finished: {json.dumps(states, indent=1)}\npods {pods}\n"
            + operator_proc.logs()
        ) from None
    return {n: get_job(kube, ns, n) for n in names}


def assert_refused(kube, ns, name, body, reason, field, text, wait_for):
    failed = condition(body, C.COND_FAILED)
    assert failed.get("status") == "True" and failed["reason"] == reason, (name, failed)
    assert failed["message"].startswith(f"{field}: ") and text in failed["message"], (name, failed)
    assert failed.get("field") == field, (name, failed)  # the CRD keeps it (not pruned)
    assert body["status"]["phase"] == "Failed"
    events = wait_for(
        lambda: [
            e for e in events_for(kube, ns, name) if e.reason == reason and e.type == "Warning"
        ],
        timeout=15,
        message=f"{name}: a Warning Event {reason}",
    )
    assert text in events[0].message
    assert workers(kube, ns, name) == [], f"{name}: worker pods were created"


def _variant(root, name, change) -> str:
    d = root / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(root / "model", d)
    change(d)
    return str(d)


def _no_config(d):
    (d / "config.json").unlink()


def _dense(d):
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))


def _other_moe(d):
    cfg = {"model_type": "olmoe_x", "num_experts": 64, "num_experts_per_tok": 8}
    (d / "config.json").write_text(json.dumps(cfg))


def _missing_shard(d):
    max(d.glob("*.safetensors")).unlink()


def _truncated(d):
    f = min(d.glob("*.safetensors"))
    with f.open("r+b") as h:
        h.truncate(f.stat().st_size - 64)


def _quantized(d):
    from test_model_inspect import _rewrite_dtype

    _rewrite_dtype(min(d.glob("*.safetensors")), "I8")


def _big_tokenizer(d):
    make_tokenizer(d, extra_ids=400)


BAD_MODELS = [
    ("no-config", _no_config, "ModelConfigMissing", "has no config.json"),
    ("dense", _dense, "ModelNotMoE", "is not a Mixture-of-Experts model"),
    ("other-moe", _other_moe, "UnsupportedArchitecture", "supported model_type values: "),
    ("missing-shard", _missing_shard, "ModelShardsInvalid", "named by the index, not in the"),
    ("truncated", _truncated, "ModelShardsInvalid", "the header declares"),
    ("quantized", _quantized, "UnsupportedDtype", "tensors stored as I8"),
    ("big-tokenizer", _big_tokenizer, "TokenizerVocabMismatch", "the tokenizer has 446 token ids"),
]


def test_bad_models_are_refused_before_any_worker(kube, ns, work, operator_proc, wait_for):
    names = []
    for slug, change, _, _ in BAD_MODELS:
        path = _variant(work, f"bad-{slug}", change)
        names.append(f"model-{slug}")
        apply_job(kube, ns, job(names[-1], work, model=model_from(path)))
    # model.path without a volume is a directory in the image: here, none
    apply_job(kube, ns, job("model-not-found", work, model={"path": "/no/such/model"}))
    bodies = wait_done(kube, ns, [*names, "model-not-found"], wait_for, operator_proc)
    for name, (_, _, reason, text) in zip(names, BAD_MODELS, strict=True):
        assert_refused(kube, ns, name, bodies[name], reason, "spec.model.path", text, wait_for)
    text = "/no/such/model is not a directory"
    body = bodies["model-not-found"]
    assert_refused(
        kube, ns, "model-not-found", body, "ModelNotFound", "spec.model.path", text, wait_for
    )


BAD_DATA = [
    ("missing-field", '{"text": "a b"}\n{"body": "c"}\n', "x.jsonl row 1: no field 'text'"),
    ("empty-file", "", "x.jsonl: the file has no rows"),
    ("undecodable", '{"text": "a"}\n{"text": "b\n', "x.jsonl row 1: not JSON"),
]


def test_bad_data_is_refused_before_any_worker(kube, ns, work, operator_proc, wait_for):
    names = []
    for slug, content, _ in BAD_DATA:
        d = work / f"data-{slug}"
        d.mkdir()
        (d / "x.jsonl").write_text(content)
        names.append(f"data-{slug}")
        data = {"kind": "JSONL", "volume": {"hostPath": {"path": str(d)}}}
        apply_job(kube, ns, job(names[-1], work, data=data))
    chat = write_jsonl(work / "data-chat" / "c.jsonl", chats(4))
    plain = make_tokenizer(work / "plain-model", chat_template=False)
    shutil.copytree(
        work / "model",
        work / "model-no-template",
        ignore=shutil.ignore_patterns("*token*", "chat_template*"),
    )
    for f in plain.iterdir():
        shutil.copy(f, work / "model-no-template" / f.name)
    names.append("data-no-template")
    data = {"kind": "JSONL", "format": "Chat", "volume": {"hostPath": {"path": str(chat.parent)}}}
    apply_job(
        kube,
        ns,
        job(names[-1], work, data=data, model=model_from(work / "model-no-template")),
    )
    texts = [t for _, _, t in BAD_DATA] + ["format Chat needs a chat template"]
    bodies = wait_done(kube, ns, names, wait_for, operator_proc)
    for name, text in zip(names, texts, strict=True):
        assert_refused(kube, ns, name, bodies[name], "InvalidData", "spec.data", text, wait_for)


def test_jsonl_and_parquet_prepare_once_and_train(kube, ns, work, operator_proc, wait_for):
    jsonl = write_jsonl(work / "corpus" / "a.jsonl", [{"text": t} for t in sentences(80)])
    pq = write_parquet(work / "pq", [{"body": t} for t in sentences(80, 2)])
    specs = {
        "jsonl-a": {"kind": "JSONL", "volume": {"hostPath": {"path": str(jsonl.parent)}}},
        "parquet-a": {
            "kind": "Parquet",
            "field": "body",
            "volume": {"hostPath": {"path": str(pq)}},
        },
    }
    for name, data in specs.items():
        apply_job(kube, ns, job(name, work, data=data))
    first = wait_done(kube, ns, list(specs), wait_for, operator_proc, timeout=600)
    for name, body in first.items():
        assert condition(body, C.COND_SUCCEEDED).get("status") == "True", (name, body["status"])
        st = body["status"]["data"]
        assert st["phase"] == "Done" and st["reused"] is False and st["documents"] == 80, st
        assert st["path"].startswith("/ckpt/prepared-data/")
        assert condition(body, C.COND_DATA_PREPARED)["reason"] == C.R_DATA_PREPARED
        plan = json.loads(kube.core.read_namespaced_config_map(f"{name}-plan", ns).data[C.PLAN_KEY])
        assert plan["training"]["data"] == {"kind": "prepared", "path": st["path"]}
        assert body["status"]["progress"]["step"] == 3
    # the same data again: the prepare pod finds the shards by their key
    apply_job(kube, ns, job("jsonl-b", work, data=specs["jsonl-a"]))
    again = wait_done(kube, ns, ["jsonl-b"], wait_for, operator_proc, timeout=600)["jsonl-b"]
    assert condition(again, C.COND_SUCCEEDED).get("status") == "True", again["status"]
    st = again["status"]["data"]
    assert st["reused"] is True and st["path"] == first["jsonl-a"]["status"]["data"]["path"]


def test_the_local_example_plans_from_the_directory_and_trains(
    kube, ns, work, operator_proc, wait_for
):
    """examples/finetune-local.yaml (README "Fine-tune your own model"), its host paths moved to
    this test's directory: a save_pretrained model with a tokenizer, chat JSONL (SFT), 2 ranks."""
    chat = write_jsonl(work / "sft" / "c.jsonl", chats(40, 3))
    doc = example("finetune-local.yaml")
    spec = doc["spec"]
    spec["model"]["volume"]["hostPath"]["path"] = str(work / "model")
    spec["data"]["volume"]["hostPath"]["path"] = str(chat.parent)
    spec["checkpoint"]["volume"]["hostPath"]["path"] = str(work / "ck")
    spec["output"]["volume"]["hostPath"]["path"] = str(work / "export")
    spec["training"]["steps"] = 4
    name = doc["metadata"]["name"]
    apply_job(kube, ns, doc)
    body = wait_done(kube, ns, [name], wait_for, operator_proc, timeout=600)[name]
    assert condition(body, C.COND_SUCCEEDED).get("status") == "True", body["status"]
    plan = json.loads(kube.core.read_namespaced_config_map(f"{name}-plan", ns).data[C.PLAN_KEY])
    config = json.loads((work / "model" / "config.json").read_text())
    assert plan["model"]["hfConfig"] == config
    assert plan["model"]["path"] == "/model" and plan["model"]["preset"] is None
    assert plan["output"] == {"path": "/output"}
    model = body["status"]["model"]
    assert plan["model"]["contentHash"] == model["contentHash"]
    assert model["family"] == "mixtral" and model["tokenizer"] is True
    assert condition(body, C.COND_MODEL_INSPECTED)["reason"] == C.R_MODEL_INSPECTED
    data = body["status"]["data"]
    assert 0 < data["lossTokens"] < data["tokens"]
    assert plan["training"]["data"] == {"kind": "prepared", "path": data["path"]}
    assert body["status"]["progress"]["step"] == 4


def test_model_changed_after_planning_is_refused(kube, ns, work, operator_proc, wait_for):
    path = _variant(work, "changing", lambda d: None)
    spec = job("changing", work, model=model_from(path))
    spec["spec"]["runPolicy"]["suspend"] = True
    apply_job(kube, ns, spec)
    wait_for(
        lambda: condition(get_job(kube, ns, "changing"), C.COND_SUSPENDED).get("status") == "True",
        timeout=120,
        message="planned and suspended\n" + operator_proc.logs(),
    )
    planned = json.loads(
        kube.core.read_namespaced_config_map("changing-plan", ns).data[C.PLAN_KEY]
    )["model"]["contentHash"]
    cfg = json.loads((work / "changing" / "config.json").read_text())
    cfg["router_aux_loss_coef"] = 0.5
    (work / "changing" / "config.json").write_text(json.dumps(cfg))
    kube.custom.patch_namespaced_custom_object(
        C.GROUP, C.VERSION, ns, C.PLURAL, "changing", {"spec": {"runPolicy": {"suspend": False}}}
    )
    body = wait_done(kube, ns, ["changing"], wait_for, operator_proc)["changing"]
    text = f"changed after the plan was made (content hash {planned[:19]} at planning"
    assert_refused(kube, ns, "changing", body, "ModelChanged", "spec.model.path", text, wait_for)


LOSS_RE = re.compile(r"step (\d+)/\d+ loss ([0-9.]+)")


def _losses(node_agent, ns, name) -> dict[int, float]:
    text = node_agent.read_log(ns, f"{name}-worker-0")
    return {int(s): float(v) for s, v in LOSS_RE.findall(text)}


def test_export_round_trip_through_the_operator(
    kube, ns, work, node_agent, operator_proc, wait_for
):
    """Job A fine-tunes the model directory on JSONL and exports; job B takes A's export as
    spec.model.path, the same text as Parquet and routingStatsFrom A. The data packs into exactly
    two rows at seqLen 32, so every step of both jobs trains on the
    same batch: B's first loss (A's exported weights) matches A's last (the weights one update
    earlier, at the cosine schedule's end) within 1%, far from A's first (the directory's weights),
    and B's export loads with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    words = " ".join(sentences(40, 7)).split()
    # 32 + 31 words, each document + EOS: 65 tokens = two rows of 33 at stride 32, no partial row
    docs = [{"text": " ".join(words[:32])}, {"text": " ".join(words[32:63])}]
    jsonl = write_jsonl(work / "rt-jsonl" / "a.jsonl", docs)
    pq = write_parquet(work / "rt-pq", docs)  # one document per file, in this order

    def out(path):
        return {"path": "/output", "volume": {"hostPath": {"path": str(path)}}}

    train = {"steps": 10, "seqLen": 32, "globalBatch": 2, "microBatch": 2, "learningRate": "1e-3"}
    a = job(
        "rt-a",
        work,
        model=model_from(work / "model"),
        data={"kind": "JSONL", "volume": {"hostPath": {"path": str(jsonl.parent)}}},
        output=out(work / "rt-a-export"),
        training=train,
    )
    apply_job(kube, ns, a)
    body_a = wait_done(kube, ns, ["rt-a"], wait_for, operator_proc)["rt-a"]
    assert condition(body_a, C.COND_SUCCEEDED).get("status") == "True", body_a["status"]
    assert body_a["status"]["data"]["rows"] == 2, body_a["status"]["data"]
    assert (work / "rt-a-export" / "export.json").exists()
    # the trainer's export report, copied to the status (path in the pod, size, content hash)
    output = body_a["status"]["output"]
    assert output["path"].startswith("/output") and output["bytes"] > 0, output
    assert re.fullmatch(r"[0-9a-f]{64}", output["sha256"]), output

    b = job(
        "rt-b",
        work,
        model=model_from(work / "rt-a-export"),
        data={"kind": "Parquet", "field": "text", "volume": {"hostPath": {"path": str(pq)}}},
        output=out(work / "rt-b-export"),
        placement={"strategy": "TopologyAware", "routingStatsFrom": {"jobName": "rt-a"}},
        training=dict(train, steps=2),
    )
    apply_job(kube, ns, b)
    body_b = wait_done(kube, ns, ["rt-b"], wait_for, operator_proc)["rt-b"]
    assert condition(body_b, C.COND_SUCCEEDED).get("status") == "True", json.dumps(
        body_b["status"].get("conditions"), indent=1
    )
    plan_b = json.loads(kube.core.read_namespaced_config_map("rt-b-plan", ns).data[C.PLAN_KEY])
    assert plan_b["placement"]["routingStatsFrom"]["job"] == "rt-a", plan_b["placement"]
    assert body_b["status"]["model"]["family"] == "mixtral"

    la, lb = _losses(node_agent, ns, "rt-a"), _losses(node_agent, ns, "rt-b")
    assert sorted(la) == list(range(1, 11)) and 1 in lb, (la, lb)
    assert abs(lb[1] - la[10]) / la[10] < 0.01, (la, lb)
    assert abs(lb[1] - la[1]) / la[1] > 0.05, (la, lb)  # B did not start from the directory

    model = AutoModelForCausalLM.from_pretrained(str(work / "rt-b-export"), dtype=torch.float32)
    ids = torch.arange(32).unsqueeze(0) % model.config.vocab_size
    assert torch.isfinite(model(ids).logits).all()


def _family_model(family: str, where) -> None:
    """The seeded, perturbed ``save_pretrained`` directory the direct tests load
    (``test_pretrained_export.seeded_checkpoint``), with the word tokenizer beside it, readable
    by the pods."""
    from test_pretrained_export import seeded_checkpoint

    seeded_checkpoint(family, {}, where)
    make_tokenizer(where)
    for f in where.iterdir():
        f.chmod(0o644)


def test_every_family_trains_on_jsonl_and_exports_through_the_operator(
    kube, ns, work, node_agent, operator_proc, wait_for
):
    """Each registered family (the six DeepSpeed AutoEP has presets for and one through the
    project's own layer): a seeded ``save_pretrained`` directory as ``spec.model.path``, JSONL
    data, ``spec.output``; the job inspects, plans, prepares, trains and exports to Succeeded.
    The trainer's logits on one fixed batch (its test hook, asked for by a test-mode annotation)
    equal ``from_pretrained(model.path)``'s at the start and ``from_pretrained(export)``'s at the
    end within 1e-4 relative (fp32, CPU), and ``status.output`` is the export's manifest."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from moe_trainer import families

    def logits(path, input_ids):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            return model(input_ids=input_ids).logits

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    jsonl = write_jsonl(work / "fam-jsonl" / "a.jsonl", [{"text": s} for s in sentences(40, 3)])
    names = {}
    for family in families.NAMES:
        name = f"fam-{family.replace('_', '-')}"
        _family_model(family, work / name / "model")
        ck, out = work / name / "ck", work / name / "export"
        for d in (ck / "logits", out):
            d.mkdir(parents=True)
            os.chmod(d, 0o777)
        os.chmod(ck, 0o777)
        doc = job(
            name,
            work,
            model=model_from(work / name / "model"),
            data={"kind": "JSONL", "volume": {"hostPath": {"path": str(jsonl.parent)}}},
            checkpoint={"everySteps": 5, "volume": {"hostPath": {"path": str(ck)}}},
            output={"path": "/output", "volume": {"hostPath": {"path": str(out)}}},
        )
        doc["metadata"]["annotations"] = {f"{C.GROUP}/test-logits-dir": "/ckpt/logits"}
        apply_job(kube, ns, doc)
        names[name] = family
    bodies = wait_done(kube, ns, list(names), wait_for, operator_proc, timeout=1500)
    for name, family in names.items():
        body = bodies[name]
        if condition(body, C.COND_SUCCEEDED).get("status") != "True":
            raise AssertionError(
                f"{name}: {json.dumps(body['status'].get('conditions'), indent=1)}\n"
                + node_agent.read_log(ns, f"{name}-worker-0")[-6000:]
            )
        assert body["status"]["model"]["family"] == family
        start = torch.load(work / name / "ck" / "logits" / "start.pt")
        final = torch.load(work / name / "ck" / "logits" / "final.pt")
        assert rel(logits(work / name / "model", start["input_ids"]), start["logits"]) < 1e-4
        assert rel(final["logits"], start["logits"]) > 0.01, name  # training moved the weights
        exported = logits(work / name / "export", final["input_ids"])
        assert rel(exported, final["logits"]) < 1e-4, name
        manifest = json.loads((work / name / "export" / "export.json").read_text())
        output = body["status"]["output"]
        assert (output["bytes"], output["sha256"]) == (manifest["bytes"], manifest["sha256"])
