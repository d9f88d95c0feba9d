"""`moe-discover` as a program: outputs, exit codes, termination log, ConfigMap publishing over
plain HTTP (a tiny in-process API stand-in that answers like the API server does)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest

from moe_contracts.topology import parse_topology
from moe_trainer.discovery import main as discover
from moe_trainer.discovery import nvml_probe, publish


@pytest.fixture
def term_log(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    path.write_text("")
    monkeypatch.setattr(publish, "TERMINATION_LOG", path)
    return path


def test_fake_fixture_from_env_writes_report_and_warns_loudly(
    tmp_path, monkeypatch, capsys, term_log
):
    monkeypatch.setenv("MOE_FAKE_NVML_FIXTURE", "pcie-bridged-pairs-4")
    monkeypatch.setenv("NODE_NAME", "node-a")
    out = tmp_path / "topo.json"
    assert discover.main(["--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert "WARNING: FAKE NVML: replaying recorded fixture 'pcie-bridged-pairs-4'" in captured.err
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert (report["node"], report["source"], report["fixture"]) == (
        "node-a",
        "fake-nvml",
        "pcie-bridged-pairs-4",
    )
    assert parse_topology(report).node == "node-a"
    assert term_log.read_text().startswith(
        "node=node-a source=fake-nvml gpus=4 model=NVIDIA RTX A6000 nvlinks=16(gpu)"
    )


def test_fake_nvml_flag_overrides_env_and_no_stdout(monkeypatch, capsys):
    monkeypatch.setenv("MOE_FAKE_NVML_FIXTURE", "pcie-only-4")
    assert discover.main(["--fake-nvml", "single-h200", "--no-stdout", "--node", "n1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "fixture 'single-h200'" in captured.err and "node=n1" in captured.err


def test_unknown_fixture_exit_78(monkeypatch, capsys, term_log):
    assert discover.main(["--fake-nvml", "no-such-box"]) == nvml_probe.EXIT_CONFIG == 78
    err = capsys.readouterr().err
    assert err.startswith("moe-discover: error: fake NVML: no fake-NVML recording 'no-such-box'")
    assert len(err.strip().splitlines()) == 1
    assert term_log.read_text().startswith("error: fake NVML")


def test_fake_fixture_without_the_dev_package_exit_78(monkeypatch, capsys, term_log):
    """The images have no fake NVML (dev package): a fixture asked for there is a config error
    that says so, never a silent fall-through to the driver."""
    monkeypatch.setitem(sys.modules, "moe_fake_nvml", None)  # `import moe_fake_nvml` fails
    monkeypatch.setenv("MOE_FAKE_NVML_FIXTURE", "single-h200")
    assert discover.main([]) == nvml_probe.EXIT_CONFIG == 78
    err = capsys.readouterr().err
    assert err.startswith(
        "moe-discover: error: fake NVML asked for (--fake-nvml or "
        "$MOE_FAKE_NVML_FIXTURE) but the dev package's moe_fake_nvml is not installed"
    )
    assert len(err.strip().splitlines()) == 1 and term_log.read_text().startswith(
        "error: fake NVML"
    )


def test_no_driver_exit_69_one_line(tmp_path, monkeypatch, capsys, term_log):
    rec = {
        "kind": "NvmlRecording",
        "version": 1,
        "gpus": [],
        "nvmlInit": {"error": "LibraryNotFound"},
    }
    path = tmp_path / "no-driver.json"
    path.write_text(json.dumps(rec))
    assert discover.main(["--fake-nvml", str(path)]) == nvml_probe.EXIT_NO_DRIVER == 69
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "moe-discover: error: no NVIDIA driver on this node: NVML says NVML Shared "
        "Library Not Found (code 12); is the pod on a GPU node with the NVIDIA "
        "container runtime?"
    )
    assert "no NVIDIA driver" in term_log.read_text()


def test_real_pynvml_without_driver_is_exit_69(monkeypatch, capsys):
    """This machine has no NVIDIA driver: the real bindings must give the documented exit."""
    monkeypatch.delenv("MOE_FAKE_NVML_FIXTURE", raising=False)
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("a real NVIDIA driver is present")
    assert discover.main(["--no-stdout"]) == 69
    assert "no NVIDIA driver on this node" in capsys.readouterr().err


def test_configmap_without_namespace_outside_pod_is_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(publish, "SA_DIR", tmp_path)  # no namespace file
    assert discover.main(["--fake-nvml", "single-h200", "--configmap", "x"]) == 64
    assert "--configmap needs --namespace" in capsys.readouterr().err


class _FakeApi(BaseHTTPRequestHandler):
    """Answers POST configmaps with 201 or 409 (exists) and PUT with 200; records requests."""

    existing: ClassVar[set[str]] = set()
    requests: ClassVar[list[tuple[str, str, dict, str | None]]] = []
    fail_with: int | None = None
    drop: int = 0  # close this many connections without an answer (as a refusing server may)

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).drop:
            type(self).drop -= 1
            self.close_connection = True
            return None
        type(self).requests.append(
            (self.command, self.path, body, self.headers.get("Authorization"))
        )
        if type(self).fail_with:
            return self._reply(
                type(self).fail_with,
                {
                    "kind": "Status",
                    "message": 'configmaps is forbidden: User "system:serviceaccount:x:y" '
                    'cannot create resource "configmaps"',
                },
            )
        name = body["metadata"]["name"]
        if self.command == "POST":
            if name in type(self).existing:
                return self._reply(409, {"kind": "Status", "reason": "AlreadyExists"})
            type(self).existing.add(name)
            return self._reply(201, body)
        return self._reply(200, body)

    do_POST = do_PUT = _handle  # noqa: N815 - http.server's handler names

    def log_message(self, *args) -> None:  # keep test output clean
        pass


@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    _FakeApi.existing, _FakeApi.requests, _FakeApi.fail_with, _FakeApi.drop = set(), [], None, 0
    server = HTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("sekrit-token\n")
    monkeypatch.setenv("MOE_KUBE_API", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("MOE_KUBE_TOKEN_FILE", str(token))
    yield _FakeApi
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_publish_creates_then_replaces_configmap(fake_api, monkeypatch, capsys, term_log):
    monkeypatch.setenv("NODE_NAME", "node-a")
    args = [
        "--fake-nvml",
        "nvswitch-h100-8",
        "--no-stdout",
        "--configmap",
        "moe-topology-node-a",
        "--namespace",
        "team-a",
    ]
    assert discover.main(args) == 0
    assert discover.main(args) == 0
    (m1, p1, body, auth), (m2, _, _, _), (m3, p3, _, _) = fake_api.requests
    assert (m1, m2, m3) == ("POST", "POST", "PUT")
    assert p1 == "/api/v1/namespaces/team-a/configmaps"
    assert p3 == "/api/v1/namespaces/team-a/configmaps/moe-topology-node-a"
    assert auth == "Bearer sekrit-token"
    assert body["metadata"]["labels"] == {
        "moe-operator.io/component": "topology",
        "moe-operator.io/node": "node-a",
        "app.kubernetes.io/managed-by": "moe-operator",
    }
    assert len(body["metadata"]["annotations"]["moe-operator.io/gpu-uuid-set"]) == 16
    report = parse_topology(json.loads(body["data"]["topology.json"]))
    assert report.node == "node-a" and len(report.gpus) == 8
    assert "ConfigMap team-a/moe-topology-node-a replaced" in capsys.readouterr().err
    assert term_log.read_text().endswith("configmap=team-a/moe-topology-node-a")


def test_publish_refused_is_exit_75_with_api_message(fake_api, capsys, term_log):
    fake_api.fail_with = 403
    rc = discover.main(
        ["--fake-nvml", "single-h200", "--no-stdout", "--configmap", "c", "--namespace", "ns"]
    )
    assert rc == nvml_probe.EXIT_PUBLISH_FAILED == 75
    err = capsys.readouterr().err
    assert "could not publish the report: ConfigMap ns/c: HTTP 403: configmaps is forbidden" in err
    assert term_log.read_text().startswith("error: could not publish the report: ")
    assert "[node=" in term_log.read_text() and "gpus=1 " in term_log.read_text()


def test_publish_retries_a_dropped_connection(fake_api, capsys):
    fake_api.drop = 2
    rc = discover.main(
        ["--fake-nvml", "single-h200", "--no-stdout", "--configmap", "c", "--namespace", "ns"]
    )
    assert rc == 0 and fake_api.drop == 0 and len(fake_api.requests) == 1
    assert "ConfigMap ns/c created" in capsys.readouterr().err


def test_publish_unreachable_api_is_exit_75(monkeypatch, capsys):
    monkeypatch.setenv("MOE_KUBE_API", "http://127.0.0.1:9")  # discard port: refused
    rc = discover.main(
        ["--fake-nvml", "single-h200", "--no-stdout", "--configmap", "c", "--namespace", "ns"]
    )
    assert (
        rc == 75
        and "could not publish the report: POST http://127.0.0.1:9" in capsys.readouterr().err
    )


def test_not_in_pod_without_api_env_is_clear(monkeypatch):
    monkeypatch.delenv("MOE_KUBE_API", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(publish.PublishError, match="KUBERNETES_SERVICE_HOST is unset"):
        publish.ApiConfig.from_env()


def test_label_value_and_gpu_set_digest():
    assert publish.label_value("ip-10-0-0-1.ec2.internal") == "ip-10-0-0-1.ec2.internal"
    long = "gpu-" + "x" * 80
    value = publish.label_value(long)
    assert len(value) == 63 and value != publish.label_value(long + "y")
    a = {"gpus": [{"uuid": "GPU-1"}, {"uuid": "GPU-2"}]}
    b = {"gpus": [{"uuid": "GPU-2"}, {"uuid": "GPU-1"}]}
    assert (
        publish.gpu_set_digest(a)
        == publish.gpu_set_digest(b)
        != publish.gpu_set_digest({"gpus": [{"uuid": "GPU-1"}]})
    )
