"""Pure builders: an InferencePipeline → the objects of one group.

    stage_statefulset(pipeline, spec, index, generation) -> StatefulSet
    stage_service(pipeline, index) -> Service
    group_network_policy(pipeline, index) -> NetworkPolicy (with `pipeserve-operator --network-policies`)
    group_endpoint(pipeline, index) -> "P-g<i>-0.P-g<i>.NS.svc:50051"
    pod_group_name(pipeline, index) -> "P-g<i>" (group i's gang: Volcano PodGroup, Kueue pod group)

Contract (shared with the chart, the router discovery and the images; see docs/kubernetes.md):
* group i of pipeline P is a StatefulSet and a headless Service both named `P-g<i>`; the StatefulSet
  runs `stages` pods at once (Parallel) and never replaces them by itself (OnDelete): the operator
  replaces whole groups. The pod ordinal (`apps.kubernetes.io/pod-index`) is the rank.
* the StatefulSet's selector never includes the generation label (a selector is immutable); its pod
  template carries `pipeserve.io/group-generation`, the group incarnation the pods belong to.
* every engine flag is checked against the real `pipeserve stage` parser: an unknown flag, a flag the
  operator sets itself, or a value of the wrong shape raises `SpecError` (the operator reports it in
  status and does not retry until the spec changes).
* the stage command carries `--device` (spec.device; auto: cuda when the resources ask for nvidia.com/gpu)
  and `--connect-timeout-s` = startupDeadlineSeconds; the pod's /dev/shm, pass-through fields and
  placement are `pod.py`'s, the names the spec may not set `owned.py`'s.
`pipeline` (the CR as a dict) is read for its metadata only; what a group runs is read from `spec`, the
typed model (spec.py's PipelineSpec, parsed once a reconcile): a misspelled field is a type error, not
a silent None (tests/k8s/test_spec_typed.py keeps spec dict lookups out of the operator).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
from typing import Any

import msgspec

from pipeserve import env as pipeserve_env
from pipeserve_operator import pod
from pipeserve_operator.crd import GROUP, KIND, VERSION
from pipeserve_operator.owned import RESERVED_FLAGS as RESERVED_FLAGS
from pipeserve_operator.owned import SpecError as SpecError
from pipeserve_operator.spec import PipelineSpec

GRPC_PORT, HEALTH_PORT, RENDEZVOUS_PORT = 50051, 8080, 29500
PIPELINE_LABEL, GROUP_LABEL = "pipeserve.io/pipeline", "pipeserve.io/group"
GENERATION_LABEL, POD_INDEX_LABEL = "pipeserve.io/group-generation", "apps.kubernetes.io/pod-index"
STARTUP_PERIOD_S = 10


def group_name(pipeline: dict, index: int) -> str:
    return f"{pipeline['metadata']['name']}-g{index}"


def pod_group_name(pipeline: dict, index: int) -> str:
    """The gang of group `index`: Volcano's PodGroup name (annotation scheduling.k8s.io/group-name on
    every pod) and Kueue's pod group (label kueue.x-k8s.io/pod-group-name)."""
    return group_name(pipeline, index)


def group_endpoint(pipeline: dict, index: int) -> str:
    name, ns = group_name(pipeline, index), pipeline["metadata"]["namespace"]
    return f"{name}-0.{name}.{ns}.svc:{GRPC_PORT}"


def pipeline_selector(pipeline: dict) -> dict[str, str]:
    """The labels every stage pod of this pipeline carries (status.selector, for the scale subresource)."""
    return {
        "app.kubernetes.io/name": "pipeserve",
        "app.kubernetes.io/component": "stage",
        PIPELINE_LABEL: pipeline["metadata"]["name"],
    }


def group_selector(pipeline: dict, index: int) -> dict[str, str]:
    return {**pipeline_selector(pipeline), GROUP_LABEL: str(index)}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def owner_reference(pipeline: dict) -> dict[str, Any]:
    meta = pipeline["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(pipeline: dict, index: int) -> dict[str, Any]:
    return {
        "name": group_name(pipeline, index),
        "namespace": pipeline["metadata"]["namespace"],
        "labels": {**group_selector(pipeline, index), "app.kubernetes.io/managed-by": "pipeserve-operator"},
        "ownerReferences": [owner_reference(pipeline)],
    }


def stage_service(pipeline: dict, index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pipeline, index),
        "spec": {
            "clusterIP": "None",
            # Pod 0's DNS name must resolve before it is ready: the other ranks rendezvous with it.
            "publishNotReadyAddresses": True,
            "selector": group_selector(pipeline, index),
            "ports": [
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"},
                {"name": "health", "port": HEALTH_PORT, "targetPort": "health"},
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": "rendezvous"},
            ],
        },
    }


ROUTER_POD_LABELS = {"app.kubernetes.io/name": "pipeserve", "app.kubernetes.io/component": "router"}


def group_network_policy(pipeline: dict, index: int) -> dict[str, Any]:
    """Ingress of one group's pods: the ring and the rendezvous only from the same group (gloo and NCCL
    pick their ports at run time, so any port), stage 0's gRPC only from router pods, the health port
    (/metrics; the kubelet's probes are not subject to policies) from the namespace. Per group because a
    static policy cannot say "the same group as the target pod"."""
    own = {"podSelector": {"matchLabels": group_selector(pipeline, index)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pipeline, index),
        "spec": {
            "podSelector": {"matchLabels": group_selector(pipeline, index)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {
                    "from": [{"podSelector": {"matchLabels": dict(ROUTER_POD_LABELS)}}],
                    "ports": [{"port": GRPC_PORT, "protocol": "TCP"}],
                },
                {"from": [{"podSelector": {}}], "ports": [{"port": HEALTH_PORT, "protocol": "TCP"}]},
            ],
        },
    }


@functools.cache
def _parser() -> argparse.ArgumentParser:
    # `pipeserve stage`'s own flag definition (cli.py builds the subcommand from it too): the flags
    # cannot drift, and the operator loads neither the CLI's other subcommands nor torch.
    from pipeserve.stage_flags import stage_parser

    return stage_parser()


@functools.cache
def _stage_options() -> dict[str, argparse.Action]:
    return {opt: action for action in _parser()._actions for opt in action.option_strings}


def engine_args(engine: dict[str, Any]) -> list[str]:
    """`engine` map → `pipeserve stage` flags; raises SpecError for anything the stage would reject."""
    options, args = _stage_options(), []
    for key, value in engine.items():
        flag = "--" + key
        if key.startswith("-") or flag not in options or key in ("help", "h"):
            raise SpecError(f"engine.{key}: not a `pipeserve stage` flag")
        if key in RESERVED_FLAGS:
            raise SpecError(f"engine.{key}: set by the operator from the spec; use the spec's own field")
        action = options[flag]
        takes_value = action.nargs != 0
        if isinstance(value, bool):
            if takes_value:
                raise SpecError(f"engine.{key}: takes a value, not {str(value).lower()}")
            if value:
                args.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                args.append("--no-" + key)
        elif isinstance(value, int | float | str) and takes_value:
            args += [flag, str(value)]
        else:
            raise SpecError(f"engine.{key}: {value!r} is not a valid value for this flag")
    return args


def _number(value: float) -> str:
    """A spec number as the user wrote it: the typed model holds 4 as 4.0, the flag stays `4` (what
    the API server, which stores JSON, hands back for a whole number anyway)."""
    return str(int(value)) if float(value).is_integer() else str(value)


def stage_args(spec: PipelineSpec) -> list[str]:
    args = ["--model", spec.model.path, "--world-size", str(spec.stages)]
    args += ["--host", "0.0.0.0", "--health-port", str(HEALTH_PORT), "--grpc-port", str(GRPC_PORT)]
    args += ["--wedge-timeout-s", str(spec.wedgeTimeoutSeconds)]
    args += ["--device", pod.stage_device(spec)]
    # The group may wait for its slowest pod as long as the operator waits for it: a shorter rendezvous
    # deadline would make the ranks that started exit while rank 0 is still Pending (a restart loop).
    args += ["--connect-timeout-s", str(spec.startupDeadlineSeconds)]
    engine = spec.engine or {}  # flag name -> value: a JSON map checked against the stage's parser
    if spec.model.servedModelName and "served-model-name" not in engine:
        args += ["--served-model-name", spec.model.servedModelName]
    if spec.layerSplit:
        if len(spec.layerSplit) != spec.stages:
            raise SpecError("layerSplit: must have one entry per stage")
        args += ["--layer-split", ",".join(str(n) for n in spec.layerSplit)]
    if spec.hicache is not None and spec.hicache.hostCacheGB is not None:
        args += ["--host-cache-gb", _number(spec.hicache.hostCacheGB)]
    args += engine_args(engine)
    # Parse the whole line as the stage will: a value of the wrong type fails here, not in a crash loop.
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _parser().parse_args([*args, "--rank", "0"], namespace=argparse.Namespace())
    except SystemExit as e:
        why = err.getvalue().strip().splitlines()[-1:] or ["rejected"]
        raise SpecError(f"the stage would reject its arguments: {why[0]}") from e
    return args


def _env(pipeline: dict, index: int, spec: PipelineSpec) -> list[dict[str, Any]]:
    name, ns = group_name(pipeline, index), pipeline["metadata"]["namespace"]
    env: list[dict[str, Any]] = [
        {
            "name": pipeserve_env.RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        },
        {"name": pipeserve_env.WORLD_SIZE, "value": str(spec.stages)},
        {"name": pipeserve_env.GROUP, "value": name},  # names the group in logs and flight dumps
        {"name": pipeserve_env.MASTER_ADDR, "value": f"{name}-0.{name}.{ns}.svc"},
        {"name": pipeserve_env.MASTER_PORT, "value": str(RENDEZVOUS_PORT)},
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only: caches go to the emptyDir
    ]
    hicache = spec.hicache
    if hicache is not None and hicache.url:
        env.append({"name": pipeserve_env.HICACHE_URL, "value": hicache.url})
    elif hicache is not None and hicache.secretRef is not None:
        secret = {"secretKeyRef": {"name": hicache.secretRef.name, "key": hicache.secretRef.key}}
        env.append({"name": pipeserve_env.HICACHE_URL, "valueFrom": secret})
    nccl = spec.nccl
    if nccl is not None and nccl.socketIfname:
        env += [{"name": n, "value": nccl.socketIfname} for n in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")]
    if nccl is not None and nccl.debug:
        env.append({"name": "NCCL_DEBUG", "value": nccl.debug})
    return env + [dict(e) for e in spec.env or []]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "health"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _container(pipeline: dict, index: int, spec: PipelineSpec, mounts: list[dict]) -> dict[str, Any]:
    """The stage container: its command line, environment, ports, probes and resources."""
    return {
        "name": "stage",
        "image": spec.image,
        "imagePullPolicy": spec.imagePullPolicy,
        "command": ["pipeserve", "stage"],
        "args": stage_args(spec),
        "env": _env(pipeline, index, spec),
        **({"envFrom": [dict(e) for e in spec.envFrom]} if spec.envFrom else {}),
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "health", "containerPort": HEALTH_PORT},
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
        ],
        "livenessProbe": _probe("/livez", 10, 3),
        "readinessProbe": _probe("/readyz", 5, 1),
        # Model loading: the startup probe allows the whole startup deadline before liveness takes over.
        "startupProbe": _probe(
            "/livez", STARTUP_PERIOD_S, math.ceil(spec.startupDeadlineSeconds / STARTUP_PERIOD_S)
        ),
        # requests/limits as given (quantities untouched); none set: {}.
        "resources": msgspec.to_builtins(spec.resources) if spec.resources is not None else {},
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _pod_spec(pipeline: dict, index: int, spec: PipelineSpec) -> tuple[dict[str, Any], dict, dict]:
    """The pod spec (container, volumes, security, the spec's pass-through fields, placement), and the
    gang scheduler's (labels, annotations) for the template's metadata."""
    volumes, mounts = pod.pod_volumes(spec, pod.stage_device(spec))
    pod_spec: dict[str, Any] = {
        "containers": [_container(pipeline, index, spec, mounts)],
        "volumes": volumes,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod.customize(pod_spec, spec)
    affinity = pod.pod_affinity(spec, group_selector(pipeline, index))
    if affinity:
        pod_spec["affinity"] = affinity
    gang_labels, annotations, scheduler = pod.gang_metadata(
        spec, pod_group_name(pipeline, index), spec.stages
    )
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    return pod_spec, gang_labels, annotations


def stage_statefulset(pipeline: dict, spec: PipelineSpec, index: int, generation: int) -> dict[str, Any]:
    """Group `index`'s StatefulSet. `pipeline` gives the metadata (name, namespace, uid) only; what the
    group runs comes from `spec`, the typed model (spec.parse), of the revision this group renders."""
    if spec.model.persistentVolumeClaim and spec.model.hostPath:
        raise SpecError("model.persistentVolumeClaim and model.hostPath are mutually exclusive")
    pod.check_owned_names(spec)
    pod_spec, gang_labels, annotations = _pod_spec(pipeline, index, spec)
    labels = {**group_selector(pipeline, index), "app.kubernetes.io/managed-by": "pipeserve-operator"}
    # The user's pod labels first: the operator's own (selector, gang, generation) win a clash.
    template_meta: dict[str, Any] = {
        "labels": {**(spec.podLabels or {}), **gang_labels, **labels, GENERATION_LABEL: str(generation)}
    }
    annotations = {**(spec.podAnnotations or {}), **annotations}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(pipeline, index),
        "spec": {
            "serviceName": group_name(pipeline, index),
            "replicas": spec.stages,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": group_selector(pipeline, index)},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }
