"""One place for the names the operator, its children and its tests agree on."""

from moe_contracts import env as E

GROUP = "moe-operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MoETrainingJob"
PLURAL = "moetrainingjobs"
SINGULAR = "moetrainingjob"
SHORT_NAMES = ("moejob",)

# Labels and annotations on everything the operator creates.
LABEL_JOB = f"{GROUP}/job"  # owning MoETrainingJob name
LABEL_COMPONENT = f"{GROUP}/component"  # discovery | worker | plan | smoke | progress
LABEL_NODE_RANK = f"{GROUP}/node-rank"
LABEL_NODE = f"{GROUP}/node"  # node a discovery pod / topology ConfigMap is about
ANNOTATION_BOOT_ID = f"{GROUP}/boot-id"  # on moe-topology-<node>, by moe-discover: host boot id
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "moe-operator"

# GPU nodes: the NVIDIA device plugin's extended resource.
GPU_RESOURCE = "nvidia.com/gpu"

# Documents (docs/contracts.md): the names are the contracts package's (moe_contracts.env)
TOPOLOGY_CONFIGMAP_PREFIX = "moe-topology-"
TOPOLOGY_KEY = E.TOPOLOGY_KEY
PLAN_KEY = E.PLAN_KEY
LAUNCHED_SPEC_KEY = "spec.json"  # in the plan ConfigMap: the immutable spec the plan was made from
PROGRESS_KEY = E.PROGRESS_KEY
ROUTING_STATS_KEY = E.ROUTING_STATS_KEY
PLAN_MOUNT_DIR = E.PLAN_MOUNT_DIR

# Trainer exit codes (docs/contracts.md)
EXIT_DATAERR = 65  # permanent: non-finite loss
EXIT_RETRYABLE = 75
EXIT_CONFIG = 78  # permanent: bad plan / config / model
PERMANENT_EXIT_CODES = frozenset({EXIT_DATAERR, EXIT_CONFIG})

# ---- MoETrainingJob status (docs/operator.md has the table) --------------------------------
FINALIZER = f"{GROUP}/cleanup"  # reserved; the operator relies on ownerReferences
LABEL_ATTEMPT = f"{GROUP}/attempt"  # gang attempt (0 = first launch, +1 per restart)
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"  # immutable-spec hash a child was built from
# Kueue plain-pod groups (spec.scheduling.gang): admitted as one unit, all pods or none
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# Volcano gangs (spec.scheduling.gang Volcano): one PodGroup per gang attempt, created before the
# pods; each pod names it in an annotation and asks for Volcano's scheduler
VOLCANO_GROUP = "scheduling.volcano.sh"
VOLCANO_VERSION = "v1beta1"
VOLCANO_API_VERSION = f"{VOLCANO_GROUP}/{VOLCANO_VERSION}"
VOLCANO_PODGROUPS = "podgroups"
VOLCANO_GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"  # the PodGroup's spec.queue
VOLCANO_SCHEDULER = "volcano"

COND_SPEC_ACCEPTED = "SpecAccepted"
COND_TOPOLOGY = "TopologyDiscovered"
COND_PLANNED = "Planned"
COND_UPGRADE_VERIFIED = "UpgradeVerified"
COND_RUNNING = "Running"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
COND_SUSPENDED = "Suspended"
COND_HEALTHY = "Healthy"
COND_RECONCILED = "Reconciled"  # only after a pass failed: False while retrying, True once past
COND_MODEL_INSPECTED = "ModelInspected"  # only with spec.model.path
COND_DATA_PREPARED = "DataPrepared"  # only with spec.data.kind JSONL / Parquet
CONDITION_TYPES = (
    COND_SPEC_ACCEPTED,
    COND_MODEL_INSPECTED,
    COND_DATA_PREPARED,
    COND_TOPOLOGY,
    COND_PLANNED,
    COND_UPGRADE_VERIFIED,
    COND_RUNNING,
    COND_SUCCEEDED,
    COND_FAILED,
    COND_SUSPENDED,
    COND_HEALTHY,
    COND_RECONCILED,
)

# Reasons (CamelCase). Grouped by the condition that usually carries them.
R_ACCEPTED = "Accepted"
R_INVALID_SPEC = "InvalidSpec"
R_IMMUTABLE_FIELD_CHANGED = "ImmutableFieldChanged"
R_DISCOVERY_PENDING = "DiscoveryPending"
R_DISCOVERED = "Discovered"
R_NO_CANDIDATE_NODES = "InsufficientNodes"
R_DISCOVERY_FAILED = "DiscoveryFailed"
R_PLAN_READY = "PlanReady"
R_PLAN_PENDING = "PlanPending"
R_INSUFFICIENT_MEMORY = "InsufficientMemory"
R_PLAN_FAILED = "PlanFailed"
R_ROUTING_STATS_UNAVAILABLE = "RoutingStatsUnavailable"
R_GATE_PENDING = "GatePending"
R_GATE_NOT_CONFIGURED = "GateNotConfigured"
R_GATE_SKIPPED = "GateSkipped"
R_LAUNCHING = "Launching"
R_WORKERS_PENDING = "WorkersPending"
R_WORKERS_RUNNING = "WorkersRunning"
R_RESTARTING = "Restarting"
R_SUSPENDED = "SuspendedByUser"
R_RESUMED = "Resumed"
R_NOT_SUSPENDED = "NotSuspended"
R_TRAINING_FINISHED = "TrainingFinished"
R_FINISHED = "Finished"
R_BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
R_PERMANENT_WORKER_FAILURE = "PermanentWorkerFailure"
R_DEADLINE_EXCEEDED = "DeadlineExceeded"
R_NODE_LOST = "NodeLost"
R_NO_FINDINGS = "NoFindings"
R_NO_PROGRESS_YET = "NoProgressYet"
R_HEALTH_FINDINGS = "HealthFindings"
R_CHILD_REJECTED = "ChildRejected"  # the API server refuses a child for good (4xx)
R_CHILD_CONFLICT = "ChildConflict"  # a child's name is taken by an object this job does not own
R_FOREIGN_PODS_IGNORED = "ForeignPodsIgnored"  # pods with the job's labels, not its ownerReference
R_PLAN_TOO_LARGE = "PlanTooLarge"
R_TRANSIENT_ERROR = "TransientError"  # 5xx, timeouts, conflicts: retried with backoff
R_RECONCILE_ERROR = "ReconcileError"  # an unexpected exception in a pass: retried with backoff
R_PASS_COMPLETED = "PassCompleted"
R_STATUS_CORRECTED = "StatusCorrected"  # a status claim the cluster contradicts was undone
# Known causes of a worker's exit, from its termination message (docs/contracts.md)
R_CHECKPOINT_NOT_WRITABLE = "CheckpointNotWritable"
R_CHECKPOINT_VOLUME_FULL = "CheckpointVolumeFull"
R_DATA_NOT_FOUND = "DataNotFound"
R_OUT_OF_MEMORY = "OutOfMemory"
# Model inspection and data preparation (the refusals of a model: core.model_report.REASONS)
R_INSPECTION_PENDING = "InspectionPending"
R_INSPECTION_FAILED = "InspectionFailed"
R_MODEL_INSPECTED = "ModelInspected"
R_MODEL_CHANGED = "ModelChanged"
R_DATA_PREPARING = "DataPreparing"
R_DATA_PREPARED = "DataPrepared"
R_DATA_PREP_FAILED = "DataPrepFailed"
R_INVALID_DATA = "InvalidData"
R_MODEL_EXPORTED = "ModelExported"
# Re-placement during a job (spec.placement.replan): an Event per switch, with the prediction
R_PLACEMENT_UPDATED = "PlacementUpdated"

# Reconcile timing (seconds)
TOPOLOGY_REPORT_MAX_AGE_SECONDS = (
    24 * 3600
)  # a cached moe-topology-<node> report younger than this is reused
DISCOVERY_TIMEOUT_SECONDS = 300
# Rendezvous and metrics ports: per job, not constant (builders.common.job_ports): on the local
# node agent every pod shares the host network, so two jobs with one fixed port collide. Even
# ports in [PORT_BASE, PORT_BASE + 2 * PORT_SLOTS) rendezvous, the odd port above serves metrics;
# the range stays below Linux's ephemeral ports (32768-60999).
PORT_BASE = 20000
PORT_SLOTS = 6000
CHECKPOINT_VOLUME = "checkpoint"
DATA_VOLUME = "data"
PLAN_VOLUME = "plan"
MODEL_VOLUME = "model"
CACHE_VOLUME = "data-cache"
OUTPUT_VOLUME = "output"
