"""Names the operator and the trainer agree on: the worker pods' environment and the ConfigMap
keys and mount paths the documents travel under (docs/contracts.md "Worker pods").

The operator writes these variables into each worker pod (``moejob_operator.builders.workers``);
the trainer's node launcher and ranks read them (``moe_trainer.launch``, ``moe_trainer.train``).
"""

from __future__ import annotations

from typing import Final

# ---- set on the worker pod by the operator (one value per pod) ----------------------------------
NODE_RANK: Final = "NODE_RANK"
NNODES: Final = "NNODES"
NPROC_PER_NODE: Final = "NPROC_PER_NODE"  # the pod's node launcher starts this many ranks
WORLD_SIZE: Final = "WORLD_SIZE"  # NNODES x NPROC_PER_NODE
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
METRICS_PORT: Final = "MOE_METRICS_PORT"  # rank 0 serves Prometheus metrics here
PLAN: Final = "MOE_PLAN"  # path of the mounted MoEPlan document
CHECKPOINT_DIR: Final = "MOE_CHECKPOINT_DIR"
PROGRESS_CONFIGMAP: Final = "MOE_PROGRESS_CONFIGMAP"
ROUTING_STATS_CONFIGMAP: Final = "MOE_ROUTING_STATS_CONFIGMAP"
PLACEMENT_CONFIGMAP: Final = "MOE_PLACEMENT_CONFIGMAP"  # PlacementUpdate (re-placement)
NODE_NAME: Final = "NODE_NAME"  # downward API: spec.nodeName
NCCL_NVLS_ENABLE: Final = "NCCL_NVLS_ENABLE"
# caches under a read-only root filesystem: the worker's scratch emptyDir
HOME: Final = "HOME"
TORCH_EXTENSIONS_DIR: Final = "TORCH_EXTENSIONS_DIR"

# ---- set per rank by the node launcher ----------------------------------------------------------
RANK: Final = "RANK"
LOCAL_RANK: Final = "LOCAL_RANK"
LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
TERMINATION_LOG: Final = "MOE_TERMINATION_LOG"  # where a rank writes its TrainerExit document

# ---- trainer fault injection (tests; the job's fault-* annotations become these) -----------------
FAULT_EXIT_AT_STEP: Final = "MOE_FAULT_EXIT_AT_STEP"
FAULT_EXIT_CODE: Final = "MOE_FAULT_EXIT_CODE"
FAULT_HOLD_CHECKPOINT_AT_STEP: Final = "MOE_FAULT_HOLD_CHECKPOINT_AT_STEP"
FAULT_NAN_AT_STEP: Final = "MOE_FAULT_NAN_AT_STEP"
# test hook: the trainer saves its logits on one fixed batch at start and end
# (moe_trainer.model.export)
TEST_LOGITS_DIR: Final = "MOE_TEST_LOGITS_DIR"
# test hook: a file read instead of the PlacementUpdate ConfigMap (tests only; never set by the
# operator)
TEST_PLACEMENT_FILE: Final = "MOE_TEST_PLACEMENT_FILE"

# ---- where the documents travel -----------------------------------------------------------------
PLAN_KEY: Final = "plan.json"  # ConfigMap <job>-plan
PLAN_MOUNT_DIR: Final = "/etc/moe"  # ... mounted read-only here
DEFAULT_PLAN_PATH: Final = f"{PLAN_MOUNT_DIR}/{PLAN_KEY}"
PROGRESS_KEY: Final = "progress.json"  # ConfigMap <job>-progress, and the checkpoint dir
ROUTING_STATS_KEY: Final = (
    "routing_stats.json"  # ConfigMap <job>-routing-stats, and the checkpoint dir
)
ROUTING_STATS_GZ_KEY: Final = f"{ROUTING_STATS_KEY}.gz"  # binaryData: gzip + base64
TOPOLOGY_KEY: Final = "topology.json"  # ConfigMap moe-topology-<node>
MODEL_REPORT_KEY: Final = "model_report.json"  # ConfigMap <job>-model (moe-inspect)
DATA_REPORT_KEY: Final = "data_report.json"  # ConfigMap <job>-data (moe-prepare-data)
VERDICT_KEY: Final = "verdict.json"  # ConfigMap moe-gate-<key>
SMOKE_PLANS_KEY: Final = "plans.json"  # ConfigMap moe-smoke-<key>-<attempt>
SMOKE_PLANS_PATH: Final = "/etc/moe-smoke/plans.json"
