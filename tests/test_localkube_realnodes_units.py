"""Pure parts of the real-node infrastructure: the cluster DNS wire format, the pause image
archive, the image cache keys, image reference names."""

from __future__ import annotations

import io
import json
import socket
import struct
import tarfile

from moe_localkube import clusterdns, images, realnode_containerd


def _query(name: str, qtype: int = 1, qid: int = 0x1234) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", qtype, 1)


class _FakeDNS(clusterdns.ClusterDNS):
    def __init__(self, table):
        self.table, self.queries = table, 0

    def lookup(self, name):
        return self.table.get(name.rstrip("."))


def _answers(reply: bytes) -> tuple[int, list[str]]:
    _qid, flags, _qd, an, _ns, _ar = struct.unpack("!HHHHHH", reply[:12])
    ips = (
        [
            socket.inet_ntoa(reply[i + 12 : i + 16])
            for i in range(len(reply) - 16 * an, len(reply), 16)
        ]
        if an
        else []
    )
    return flags & 0xF, ips


def test_dns_answers_a_records_and_nxdomain():
    dns = _FakeDNS({"w-0.job-workers.ns.svc.cluster.local": ["10.217.3.7"]})
    rcode, ips = _answers(dns.handle(_query("w-0.job-workers.ns.svc.cluster.local")))
    assert (rcode, ips) == (0, ["10.217.3.7"])
    rcode, ips = _answers(
        dns.handle(_query("w-0.job-workers.ns.svc.cluster.local", qtype=28))
    )  # AAAA
    assert (rcode, ips) == (0, [])
    rcode, _ = _answers(dns.handle(_query("pypi.org")))
    assert rcode == 3
    reply = dns.handle(_query("x.svc.cluster.local", qid=0xBEEF))
    assert struct.unpack("!H", reply[:2])[0] == 0xBEEF
    assert dns.handle(b"\x00\x01") is None  # garbage: no answer


def test_dns_lookup_names_outside_the_cluster_domain_without_asking_the_api():
    dns = clusterdns.ClusterDNS.__new__(clusterdns.ClusterDNS)
    dns.core = None  # any API call would raise: these names never reach it
    for name in (
        "pypi.org",
        "kubernetes",
        "a.b.c.d.e.svc.cluster.local.ns.svc.cluster.local",
        "svc.cluster.local",
    ):
        assert dns.lookup(name) is None


def test_pause_image_archive(tmp_path):
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF fake pause")
    tar_path = images.pause_image_tar(tmp_path / "pause.tar", binary, ref="localhost/p:1")
    with tarfile.open(tar_path) as tar:
        (manifest,) = json.loads(tar.extractfile("manifest.json").read())
        assert manifest["RepoTags"] == ["localhost/p:1"]
        config = json.loads(tar.extractfile(manifest["Config"]).read())
        assert (
            config["config"]["Entrypoint"] == ["/pause"]
            and config["config"]["User"] == "65535:65535"
        )
        with tarfile.open(
            fileobj=io.BytesIO(tar.extractfile(manifest["Layers"][0]).read())
        ) as layer:
            member = layer.getmember("pause")
            assert (
                member.mode == 0o755 and layer.extractfile(member).read() == b"\x7fELF fake pause"
            )


def test_image_keys_follow_what_the_dockerfile_copies(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "other.txt").write_text("not copied\n")
    df = tmp_path / "Dockerfile"
    df.write_text("FROM x:1 AS b\nCOPY pkg/ \\\n  pkg/\nCOPY --from=b /w /w\n")
    assert images.copied_sources(df) == ["pkg/"]
    key = images.context_digest(df, tmp_path)
    (tmp_path / "other.txt").write_text("changed\n")
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"cache")
    assert images.context_digest(df, tmp_path) == key  # not copied / bytecode: same key
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert images.context_digest(df, tmp_path) != key


def test_repository_dockerfiles_pins_and_sources():
    assert "torch==2.13.0" in images.dockerfile_pins()
    for name, path in images.DOCKERFILES.items():
        sources = images.copied_sources(path)
        assert {"operator/moejob_operator/", "operator/moe_contracts/"} <= set(sources), name
        # the product only: the dev package (local cluster, demo, fake NVML, faults) stays out
        assert not any(
            s.rstrip("/") in ("operator", "operator/dev") or s.startswith("operator/dev/")
            for s in sources
        ), (name, sources)


def test_image_reference_normalisation():
    assert (
        realnode_containerd.normalize_ref("moe-trainer:local")
        == "docker.io/library/moe-trainer:local"
    )
    assert realnode_containerd.normalize_ref("team/img:1") == "docker.io/team/img:1"
    assert realnode_containerd.normalize_ref("localhost/moe-pause:v1") == "localhost/moe-pause:v1"
    assert (
        realnode_containerd.normalize_ref("registry.example.com:5000/a/b:2")
        == "registry.example.com:5000/a/b:2"
    )


def test_image_keys_skip_what_dockerignore_keeps_out(tmp_path):
    (tmp_path / "operator" / "infra").mkdir(parents=True)
    (tmp_path / "operator" / "pkg.py").write_text("a\n")
    (tmp_path / "operator" / "infra" / "x.py").write_text("b\n")
    (tmp_path / ".dockerignore").write_text("**/__pycache__\noperator/infra\n")
    df = tmp_path / "Dockerfile"
    df.write_text("FROM x:1\nCOPY operator/ operator/\n")
    key = images.context_digest(df, tmp_path)
    (tmp_path / "operator" / "infra" / "x.py").write_text("changed\n")
    assert images.context_digest(df, tmp_path) == key
    (tmp_path / "operator" / "pkg.py").write_text("changed\n")
    assert images.context_digest(df, tmp_path) != key
