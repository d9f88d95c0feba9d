"""``TopologyReport`` v1 (docs/contracts.md): what the discovery program read from NVML on one node.

The discovery program (``moe-discover``, trainer image) writes it into ConfigMap
``moe-topology-<node>``; the planning core reads it with :func:`parse_topology` and derives NVLink
groups and the cluster view from it (``moejob_operator.core.topology``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .errors import check_kind_version, from_validation_error

DOCUMENT = "TopologyReport"

_PCI_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def parse_pci_bus_id(text: str) -> tuple[int, int, int, int]:
    """``'00000000:18:00.0'`` or ``'0000:18:00.0'`` -> ``(domain, bus, device, function)``."""
    m = _PCI_RE.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{text!r} is not a PCI bus id")
    domain, bus, dev, fn = (int(g, 16) for g in m.groups())
    if dev > 0x1F:
        raise ValueError(f"{text!r} is not a PCI bus id (device > 0x1f)")
    return domain, bus, dev, fn


def normalize_pci_bus_id(text: str) -> str:
    """Canonical form: 4-hex domain, lower case (``0000:18:00.0``); NVML's 8-hex form is equal."""
    domain, bus, dev, fn = parse_pci_bus_id(text)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


class _Doc(BaseModel):
    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore"
    )


class NvLink(_Doc):
    link: int = Field(ge=0)
    remote: Literal["gpu", "switch", "other"]
    # null when NVML cannot see the remote (NVSwitches behind a VM answer FFFFFFFF:FF:FF.0, read
    # as null too); a "gpu" remote must name a GPU of the report (checked below)
    remote_pci_bus_id: str | None = None

    @field_validator("remote_pci_bus_id")
    @classmethod
    def _norm(cls, v: str | None) -> str | None:
        if v is None or re.fullmatch(r"f{4,8}:ff:ff\.0", v.strip().lower()):
            return None
        return normalize_pci_bus_id(v)


class Gpu(_Doc):
    index: int = Field(ge=0)
    uuid: str
    name: str
    memory_bytes: int = Field(gt=0)
    pci_bus_id: str
    numa_node: int | None = None
    compute_capability: str
    mig_enabled: bool = False
    nvlinks: tuple[NvLink, ...] = ()
    nvlink_link_g_bps: float = Field(default=0.0, ge=0.0, alias="nvlinkLinkGBps")

    _norm = field_validator("pci_bus_id")(lambda v: normalize_pci_bus_id(v))

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, v: str) -> str:
        if not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f"{v!r} is not a compute capability like '9.0'")
        return v

    @property
    def nvlink_gbps(self) -> float:
        """Total NVLink bandwidth out of this GPU, per direction."""
        return len(self.nvlinks) * self.nvlink_link_g_bps


class TopologyReport(_Doc):
    """TopologyReport v1 (docs/contracts.md). Build with ``parse_topology``."""

    kind: Literal["TopologyReport"] = "TopologyReport"
    version: Literal[1] = 1
    node: str = Field(min_length=1)
    source: Literal["nvml", "fake-nvml"]
    fixture: str | None = None
    collected_at: str
    driver_version: str
    cuda_driver_version: str
    gpus: tuple[Gpu, ...] = Field(min_length=1)
    p2p_nvlink: tuple[tuple[bool, ...], ...] = Field(alias="p2pNvlink")
    pcie_level: tuple[tuple[int, ...], ...]

    @model_validator(mode="after")
    def _consistent(self) -> TopologyReport:
        n = len(self.gpus)
        for i, gpu in enumerate(self.gpus):
            if gpu.index != i:
                raise ValueError(
                    f"gpus[{i}].index: {gpu.index} != position {i} "
                    "(GPUs must be listed in index order)"
                )
        seen: dict[str, int] = {}
        for i, gpu in enumerate(self.gpus):
            if gpu.pci_bus_id in seen:
                raise ValueError(
                    f"gpus[{i}].pciBusId: {gpu.pci_bus_id!r} "
                    f"duplicates gpus[{seen[gpu.pci_bus_id]}]"
                )
            seen[gpu.pci_bus_id] = i
        for i, gpu in enumerate(self.gpus):
            links = [lk.link for lk in gpu.nvlinks]
            if len(set(links)) != len(links):
                raise ValueError(f"gpus[{i}].nvlinks: link numbers repeat {links}")
            for j, lk in enumerate(gpu.nvlinks):
                if lk.remote == "gpu" and (
                    lk.remote_pci_bus_id not in seen or seen[lk.remote_pci_bus_id] == i
                ):
                    raise ValueError(
                        f"gpus[{i}].nvlinks[{j}].remotePciBusId: {lk.remote_pci_bus_id!r} "
                        "is not another GPU of this report"
                    )
        for name, mat in (("p2pNvlink", self.p2p_nvlink), ("pcieLevel", self.pcie_level)):
            if len(mat) != n or any(len(row) != n for row in mat):
                shape = f"{len(mat)}x{'/'.join(str(len(r)) for r in mat)}"
                raise ValueError(
                    f"{name}: matrix is {shape}, expected {n}x{n} (one row and column per GPU)"
                )
        for i in range(n):
            for j in range(n):
                if self.pcie_level[i][j] != self.pcie_level[j][i]:
                    raise ValueError(
                        f"pcieLevel[{i}][{j}]: {self.pcie_level[i][j]} != "
                        f"pcieLevel[{j}][{i}] (not symmetric)"
                    )
        return self

    def index_of_pci(self, pci_bus_id: str) -> int | None:
        key = normalize_pci_bus_id(pci_bus_id)
        return next((g.index for g in self.gpus if g.pci_bus_id == key), None)


def parse_topology(obj: Any) -> TopologyReport:
    """Validate a decoded TopologyReport document; raises ``DocumentError`` naming the field."""
    check_kind_version(DOCUMENT, obj)
    try:
        return TopologyReport.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_error(DOCUMENT, exc) from None


def report_to_json(report: TopologyReport) -> dict[str, Any]:
    """The document as JSON (camelCase, normalised PCI bus ids)."""
    return report.model_dump(mode="json", by_alias=True)
