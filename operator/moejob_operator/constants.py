"""One place for the names the operator, its children and its tests agree on."""

GROUP = "moe-operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MoETrainingJob"
PLURAL = "moetrainingjobs"
SINGULAR = "moetrainingjob"
SHORT_NAMES = ("moejob",)

# Labels and annotations on everything the operator creates.
LABEL_PREFIX = GROUP
LABEL_JOB = f"{GROUP}/job"                # owning MoETrainingJob name
LABEL_COMPONENT = f"{GROUP}/component"    # discovery | worker | plan | smoke | progress
LABEL_NODE_RANK = f"{GROUP}/node-rank"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "moe-operator"

# GPU nodes: what the NVIDIA device plugin and GPU Feature Discovery publish.
GPU_RESOURCE = "nvidia.com/gpu"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_COUNT = "nvidia.com/gpu.count"
GFD_MEMORY = "nvidia.com/gpu.memory"      # MiB
GFD_CLIQUE = "nvidia.com/gpu.clique"

# Documents (docs/contracts.md)
TOPOLOGY_CONFIGMAP_PREFIX = "moe-topology-"
TOPOLOGY_KEY = "topology.json"
PLAN_KEY = "plan.json"
PROGRESS_KEY = "progress.json"
ROUTING_STATS_KEY = "routing_stats.json"
PLAN_MOUNT_DIR = "/etc/moe"

# Trainer exit codes (docs/contracts.md)
EXIT_OK = 0
EXIT_DATAERR = 65      # permanent: non-finite loss
EXIT_RETRYABLE = 75
EXIT_CONFIG = 78       # permanent: bad plan / config / model
PERMANENT_EXIT_CODES = frozenset({EXIT_DATAERR, EXIT_CONFIG})
