"""`moe-discover`: write this node's TopologyReport v1 to stdout, a file and/or a ConfigMap.

    moe-discover                                   # real NVML, report on stdout
    moe-discover --output /tmp/topo.json --record /tmp/nvml-recording.json
    moe-discover --configmap moe-topology-node-a --namespace team-a   # inside the discovery pod
    MOE_FAKE_NVML_FIXTURE=nvswitch-h100-8 moe-discover  # recorded fixture, says so loudly

Exit codes: nvml_probe.EXIT_* (docs/discovery.md). Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import nvml_probe, nvml_record, publish
from .nvml_probe import DiscoveryError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-discover", description=__doc__.split("\n")[0])
    p.add_argument("--output", "-o", help="also write the report to this file ('-' = stdout)")
    p.add_argument(
        "--no-stdout",
        action="store_true",
        help="do not print the report on stdout (default: print it)",
    )
    p.add_argument("--configmap", help="publish into this ConfigMap (key topology.json)")
    p.add_argument("--namespace", help="namespace of --configmap (default: the pod's)")
    p.add_argument("--node", help="node name (default: $NODE_NAME, else the hostname)")
    p.add_argument(
        "--fake-nvml",
        metavar="NAME|PATH",
        help=f"replay a recorded NVML fixture instead of the driver "
        f"(also ${nvml_record.FIXTURE_ENV}); dev/test only: needs the dev package's "
        f"moe_fake_nvml, which the images do not install",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        help="also write what real NVML answered, as a fake-NVML recording",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="list NVML calls that failed")
    return p


def node_name(explicit: str | None) -> str:
    return explicit or os.environ.get("NODE_NAME") or socket.gethostname()


def _pod_namespace() -> str | None:
    try:
        return (publish.SA_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


def _fake_nvml():
    """The one way into the fake NVML (dev tooling, docs/discovery.md): the dev package's
    `moe_fake_nvml`, which a developer's venv has and the local cluster's GPU-like nodes provide
    to their containers; the images do not install it."""
    try:
        import moe_fake_nvml
    except ImportError as err:
        raise DiscoveryError(
            f"fake NVML asked for (--fake-nvml or ${nvml_record.FIXTURE_ENV}) but "
            f"the dev package's moe_fake_nvml is not installed here ({err}); "
            "on a real node, unset it",
            nvml_probe.EXIT_CONFIG,
        ) from err
    return moe_fake_nvml


def _nvml(args: argparse.Namespace) -> tuple[Any, str, str | None]:
    """(nvml module-like object, source, fixture name)."""
    fixture = args.fake_nvml or os.environ.get(nvml_record.FIXTURE_ENV) or None
    if fixture:
        fake = _fake_nvml()
        try:
            recording, name = fake.load_recording(fixture)
        except fake.RecordingError as err:
            raise DiscoveryError(f"fake NVML: {err}", nvml_probe.EXIT_CONFIG) from err
        print(
            f"moe-discover: WARNING: FAKE NVML: replaying recorded fixture {name!r}; "
            "this report describes no real hardware",
            file=sys.stderr,
        )
        return fake.FakeNvml(recording), "fake-nvml", name
    import pynvml  # only here: a fake run must not need the bindings' library

    if args.record:
        name = Path(args.record).name.removesuffix(".json").removesuffix(".recording")
        return nvml_record.RecordingNvml(pynvml, fixture=name), "nvml", None
    return pynvml, "nvml", None


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.configmap and not (args.namespace or _pod_namespace()):
        raise DiscoveryError("--configmap needs --namespace outside a pod", nvml_probe.EXIT_USAGE)
    nvml, source, fixture = _nvml(args)
    node = node_name(args.node)
    report, failed = nvml_probe.probe(nvml, node=node, source=source, fixture=fixture)
    if args.verbose:
        for line in failed:
            print(f"moe-discover: NVML: {line}", file=sys.stderr)
    if isinstance(nvml, nvml_record.RecordingNvml):
        nvml.recording["description"] = (
            f"recorded by moe-discover on node {node!r}, driver {report['driverVersion']}"
        )
        Path(args.record).write_text(json.dumps(nvml.recording, indent=1) + "\n")
    text = json.dumps(report, indent=2) + "\n"
    if args.output and args.output != "-":
        Path(args.output).write_text(text)
    if not args.no_stdout or args.output == "-":
        sys.stdout.write(text)
    line = publish.summary(report)
    print(f"moe-discover: {line}", file=sys.stderr)
    if args.configmap:
        namespace = args.namespace or _pod_namespace()
        try:
            how = publish.publish_configmap(report, args.configmap, namespace)
        except publish.PublishError as err:
            raise DiscoveryError(
                f"could not publish the report: {err} [{line}]", nvml_probe.EXIT_PUBLISH_FAILED
            ) from err
        print(f"moe-discover: ConfigMap {namespace}/{args.configmap} {how}", file=sys.stderr)
        line += f" configmap={namespace}/{args.configmap}"
    publish.write_termination_log(line)
    return nvml_probe.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except DiscoveryError as err:
        print(f"moe-discover: error: {err}", file=sys.stderr)
        publish.write_termination_log(f"error: {err}")
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
