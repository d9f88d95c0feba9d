"""Topology discovery: read NVML on a GPU node and write a TopologyReport v1 (docs/contracts.md).

`nvml_probe.probe(nvml, node=...)` does the work against any module-like NVML object: the real
`pynvml` or `nvml_record.RecordingNvml` (wraps the real one and records what it answered); in
tests, the dev package's `moe_fake_nvml.FakeNvml` (replays a recording; not in the images).
`main.main` is the `moe-discover` console script.
"""
