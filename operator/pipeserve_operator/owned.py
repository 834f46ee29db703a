"""What the operator owns in a stage pod: the names a spec may not set itself.

One list, read by both checks so they cannot drift: the CRD's CEL rules (`crd.py`, refused at
admission) and the builders (`resources.py` / `pod.py`, refused with a `SpecError` naming the field,
for a CR stored before the rule existed or an API server that skipped it).
"""

from __future__ import annotations

from pipeserve import env as pipeserve_env


class SpecError(ValueError):
    """The spec cannot be turned into runnable pods (retrying without a spec change will not help)."""


# Engine flags the operator derives from the spec's own fields: setting them through `engine` would
# contradict it (device ← spec.device, connect-timeout-s ← startupDeadlineSeconds).
RESERVED_FLAGS = frozenset(
    {"model", "rank", "world-size", "master-addr", "master-port", "rendezvous-file", "host", "health-port"}
    | {"grpc-port", "wedge-timeout", "wedge-timeout-s", "layer-split", "host-cache-gb", "hicache-url"}
    | {"device", "connect-timeout-s"}
)
# Environment variables the operator sets on the stage container (some only with hicache / nccl; all
# are refused in spec.env so that a spec's meaning does not change with another field).
OWNED_ENV = (
    pipeserve_env.RANK,
    pipeserve_env.WORLD_SIZE,
    pipeserve_env.GROUP,
    pipeserve_env.HICACHE_URL,
    pipeserve_env.MASTER_ADDR,
    pipeserve_env.MASTER_PORT,
    "HOME",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_DEBUG",
)
# The pod's own volumes (scratch /tmp, the model PVC/hostPath, the NCCL shared-memory emptyDir).
OWNED_VOLUMES = ("tmp", "model", "dshm")
# Mount paths of the operator's volumes (the model's mountPath is owned only when it mounts one).
OWNED_MOUNT_PATHS = ("/tmp", "/dev/shm")
OWNED_LABEL_PREFIX = "pipeserve.io/"
# Selector labels, the StatefulSet's pod index, and the gang schedulers' keys the operator writes.
OWNED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "apps.kubernetes.io/pod-index",
    "kueue.x-k8s.io/pod-group-name",
    "kueue.x-k8s.io/queue-name",
)
OWNED_ANNOTATIONS = ("scheduling.k8s.io/group-name", "kueue.x-k8s.io/pod-group-total-count")


def cel_list(names: tuple[str, ...] | frozenset[str]) -> str:
    """A CEL list literal of `names` (sorted: the CRD's text is stable)."""
    return "[" + ", ".join(f"'{n}'" for n in sorted(names)) + "]"
