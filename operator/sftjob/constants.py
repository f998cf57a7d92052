"""Names and numbers that more than one part of sftjob must agree on, kept in one place."""

API_GROUP = "sftjob.io"
API_VERSION = "v1alpha1"
KIND = "SFTJob"
PLURAL = "sftjobs"

# Labels and annotations the operator puts on (and reads from) the objects it owns.
LABEL_JOB = "sftjob.io/job"
LABEL_ATTEMPT = "sftjob.io/attempt"
LABEL_ROLE = "sftjob.io/role"
LABEL_RANK = "sftjob.io/node-rank"
# The uid of the SFTJob that owns the object (like batch.kubernetes.io/controller-uid): a job deleted and
# created again under the same name is a new uid, and must not take its predecessor's pods for its own.
LABEL_CONTROLLER_UID = "sftjob.io/controller-uid"
# Written by the trainer on its own Pod (JSON); read by the operator. The trainer never opens a
# connection to the operator and the operator never connects to a pod: both go through the API server.
ANNOTATION_PROGRESS = "sftjob.io/progress"
ANNOTATION_CHECKPOINT = "sftjob.io/last-checkpoint"
# The SFTJob CRD's schema revision, its annotation: bumped with every schema change, so that an operator
# finds a CRD older than its own in the cluster (whose schema drops the fields it writes).
ANNOTATION_SCHEMA_REVISION, CRD_SCHEMA_REVISION = "sftjob.io/schema-revision", 6

# Kueue's pod integration (spec.queueName): the LocalQueue, and each attempt's pods as one pod group that
# Kueue admits whole (gang admission) and finishes when one of them fails (the operator starts the next).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE_IN_GROUP = "kueue.x-k8s.io/retriable-in-group"
KUEUE_FINALIZER = "kueue.x-k8s.io/managed"  # Kueue's webhook puts it on every pod it manages
KUEUE_POD_INDEX_LABEL = "kueue.x-k8s.io/pod-group-pod-index-label"  # names the label with a pod's index
KUEUE_API_GROUP, KUEUE_API_VERSION, KUEUE_WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"

# NVIDIA GPU Feature Discovery labels and the device plugin's resource name.
GPU_RESOURCE = "nvidia.com/gpu"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"
GFD_COUNT = "nvidia.com/gpu.count"
GFD_COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
GFD_COMPUTE_MINOR = "nvidia.com/gpu.compute.minor"
GFD_FAMILY = "nvidia.com/gpu.family"
GFD_DRIVER_MAJOR = "nvidia.com/cuda.driver.major"
# The taint GPU node pools usually carry; GPU pods tolerate it.
GPU_TAINT_KEY = "nvidia.com/gpu"

# Steering annotations for pods on the local fake cluster's KWOK nodes (tests, demo; never production).
SIM_OUTCOME = "sim.sftjob.dev/outcome"  # succeed | fail | oomkill
SIM_EXIT_CODE = "sim.sftjob.dev/exit-code"
SIM_MESSAGE = "sim.sftjob.dev/message"
SIM_DISRUPTION = "sim.sftjob.dev/disruption"  # a DisruptionTarget reason for `fail` (PreemptionByScheduler)
SIM_RUN_FOR = "sim.sftjob.dev/run-for"  # Go duration, e.g. "2s"
# On an SFTJob: the local trainer runner (hack/sftjob_dev/runner.py) backs its pods with real CPU trainers.
LOCAL_TRAINER = "sftjob.dev/local-trainer"

# Where the trainer finds things inside its pod.
CONFIG_ENV = "SFTJOB_CONFIG"
CONFIG_MOUNT = "/etc/sftjob"
CONFIG_FILE = "config.json"
# With several candidate GPU types, one plan per card beside CONFIG_FILE; the trainer loads its card's.
CONFIG_VARIANT = "config-{profile}.json"
# Beside them, the operator's map of GPU product labels (GFD's, the device name with '-' for ' ') to the
# profile keys it planned for, so a product the built-in table does not know still finds its plan.
CONFIG_PRODUCTS = "products.json"
CHECKPOINT_MOUNT = "/checkpoints"
OUTPUT_MOUNT = "/output"
MODEL_MOUNT = "/model"
DATASET_MOUNT = "/data"
TERMINATION_LOG = "/dev/termination-log"
# A writable scratch folder (an emptyDir) that is also the pod's HOME: a job's own image may have no home
# its uid 1000 can write, and Triton (Liger's kernels) compiles into a cache under it.
SCRATCH_MOUNT = "/tmp"
TRAINER_METRICS_PORT = 9401
# The longest gap between the trainer's progress reports while steps complete: well under the smallest
# spec.restartPolicy.stallTimeoutSeconds (60), so only a step or setup phase that itself takes longer
# than the stall timeout can look stalled.
PROGRESS_REPORT_INTERVAL_SECONDS = 30.0
TORCHRUN_PORT = 29500
# How long torchrun's rank 0 of a multi-node job waits for the other nodes (static rendezvous; torch's
# default is 600 s) when the job sets no activeDeadlineSeconds: a peer Pending for capacity, pulling a
# cold image or waiting for GPUs the previous attempt still holds in its grace period is waited for.
RENDEZVOUS_TIMEOUT_SECONDS = 86_400

# Checkpoint layout: a checkpoint is complete only when its marker file exists.
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_COMPLETE_MARKER = "COMPLETE"
# In the checkpoint folder: the attempt that owns it; an older attempt still running commits nothing.
CHECKPOINT_OWNER_FILE = "OWNER"
# What the checkpoint volume's root holds besides the output (checkpoints, their temporary and set-aside
# folders, OWNER, the Hugging Face cache): an output path there may not be its root (``.``, ``./``) nor
# start with one of these, after any leading ``./`` (``./final`` is a folder of its own).
CHECKPOINT_VOLUME_NAMES = r"^(\./+)*(\.?/*$|(checkpoint-[0-9]+|\.cache|OWNER)(/|$)|\.tmp-|\.bad-)"
# spec.tracking.tensorboard's event files, in the checkpoint volume's root (they outlive every pod); with
# TensorBoard on, an output path there may not start with it either.
TENSORBOARD_FOLDER = "tensorboard"
TENSORBOARD_FOLDER_PATH = r"^(\./+)*tensorboard(/|$)"

# The seed guide's minimum NVIDIA driver.
MIN_DRIVER_VERSION = "580.65.06"  # CUDA 13.0's minimum: the default trainer image is CUDA 13.2
# Pods of the operator's image only go to nodes whose driver (GFD's label) is at least this major.
MIN_DRIVER_MAJOR = int(MIN_DRIVER_VERSION.split(".")[0])

DEFAULT_TRAINER_IMAGE = "ghcr.io/sftjob/trainer:0.1.0"
TRAINER_UID = 1000  # the trainer image's USER (trainer/Dockerfile); pods run as it, with it as fsGroup
