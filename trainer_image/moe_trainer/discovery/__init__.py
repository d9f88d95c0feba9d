"""Topology discovery: read NVML on a GPU node and write a TopologyReport v1 (docs/contracts.md).

`nvml_probe.probe(nvml, node=...)` does the work against any module-like NVML object: the real
`pynvml`, `fake_nvml.FakeNvml` (replays a recording) or `fake_nvml.RecordingNvml` (wraps the real
one and records what it answered). `main.main` is the `moe-discover` console script.
"""
