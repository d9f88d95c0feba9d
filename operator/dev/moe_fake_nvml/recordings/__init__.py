"""Fake-NVML recordings (JSON), shipped as package data; see docs/discovery.md."""
