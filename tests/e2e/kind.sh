#!/usr/bin/env bash
# End to end on a real cluster (issue 31, point 7): what kmock cannot prove — a real API server,
# scheduler and kubelet running the chart. Needs `kind`, Docker, helm and kubectl on a workstation;
# it cannot run on the project's CI machine (no container runtime), so its dry mode is tested there.
#
#   tests/e2e/kind.sh              # create a kind cluster, build and load the images, install the
#                                  # chart with the example pipeline, scale it, kill a stage pod, wait
#                                  # for Ready, check a completion; the cluster is deleted at the end
#   tests/e2e/kind.sh --keep       # the same, the cluster left for a look (kind delete cluster --name ...)
#   tests/e2e/kind.sh --dry-run    # no cluster: the script's syntax (bash -n, shellcheck where found),
#                                  # and the manifests it would apply, rendered with the same values and
#                                  # validated (Kubernetes 1.35 schemas; the pipeline against its CRD)
#
# The example's checkpoint is a demo model (`pipeserve demo-model`) copied onto the kind node and
# mounted by hostPath into the stage pods and the router (tokenizer), as example.model.hostPath says.
set -euo pipefail

ROOT="${E2E_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"  # E2E_ROOT: the checkout (a copied script)
CLUSTER="${E2E_CLUSTER:-pipeserve-e2e}"
NS=pipeserve-e2e
TAG=e2e
REPO=pipeserve
NODE_MODELS=/srv/pipeserve-models   # on the kind node
PY="${PYTHON:-$ROOT/.venv/bin/python}"
HELM="${HELM:-$(command -v helm || echo "$ROOT/.tools/bin/helm")}"
KUBECTL="${KUBECTL:-$(command -v kubectl || echo "$ROOT/.tools/bin/kubectl")}"
WAIT=900s

MODE=run
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --keep) MODE=keep ;;
  "") ;;
  *) echo "usage: $0 [--dry-run|--keep]" >&2; exit 2 ;;
esac

# The values the release is installed with: the example pipeline (2 stages), the locally built
# images, the demo model by hostPath, a small Redis for HiCache's L3.
VALUES=(
  --set "operator.image.repository=$REPO/operator" --set "operator.image.tag=$TAG"
  --set "router.image.repository=$REPO/router" --set "router.image.tag=$TAG"
  --set "example.enabled=true" --set "example.name=demo" --set "example.stages=2"
  --set "example.image.repository=$REPO/stage-cpu" --set "example.image.tag=$TAG"
  --set "example.model.hostPath=$NODE_MODELS" --set "example.model.path=/models/demo"
  --set "router.tokenizer.hostPath=$NODE_MODELS" --set "router.tokenizer.path=/models/demo"
  --set "example.resources.requests.cpu=250m" --set "example.resources.requests.memory=512Mi"
)

say() { printf '\n== %s\n' "$*"; }

dry_run() {
  say "syntax"
  bash -n "$0"
  if command -v shellcheck >/dev/null; then shellcheck "$0"; else echo "shellcheck not found: skipped"; fi
  say "render the release as the run installs it"
  local out
  out="$(mktemp -d)"
  "$HELM" template pipeserve "$ROOT/charts/pipeserve" -n "$NS" --include-crds "${VALUES[@]}" >"$out/release.yaml"
  "$HELM" lint --strict "$ROOT/charts/pipeserve" "${VALUES[@]}" >/dev/null
  say "validate every object it would apply"
  "$PY" - "$out/release.yaml" <<'EOF'
import sys

import jsonschema
import kubernetes_validate
import yaml

from pipeserve_operator.crd import crd_manifest

schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
objects = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
kinds = sorted({o["kind"] for o in objects})
for obj in objects:
    if obj["kind"] == "InferencePipeline":
        jsonschema.Draft4Validator(schema).validate(obj)
        spec = obj["spec"]
        assert spec["stages"] == 2 and spec["model"]["hostPath"] == "/srv/pipeserve-models", spec
    else:
        kubernetes_validate.validate(obj, "1.35", strict=True)
assert {"InferencePipeline", "Deployment", "CustomResourceDefinition"} <= set(kinds), kinds
print(f"{len(objects)} objects valid: {', '.join(kinds)}")
EOF
  rm -rf "$out"
  echo "dry run: ok"
}

need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "kind.sh needs $tool on PATH" >&2; exit 2; }
  done
}

run() {
  need kind docker "$HELM" "$KUBECTL"
  if [[ "$MODE" != keep ]]; then trap 'kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true' EXIT; fi

  say "cluster $CLUSTER"
  kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
  local k=("$KUBECTL" --context "kind-$CLUSTER" -n "$NS")

  say "images"
  make -C "$ROOT" images IMAGE_REPO="$REPO" IMAGE_TAG="$TAG"
  for image in operator router stage-cpu; do kind load docker-image --name "$CLUSTER" "$REPO/$image:$TAG"; done

  say "the demo model on the node"
  local model
  model="$(mktemp -d)"
  "$PY" -m pipeserve.cli demo-model "$model/demo"
  docker exec "$CLUSTER-control-plane" mkdir -p "$NODE_MODELS"
  docker cp "$model/demo" "$CLUSTER-control-plane:$NODE_MODELS/demo"
  rm -rf "$model"

  say "install"
  "$HELM" upgrade --install pipeserve "$ROOT/charts/pipeserve" --kube-context "kind-$CLUSTER" \
    -n "$NS" --create-namespace --wait --timeout 10m "${VALUES[@]}"
  "${k[@]}" wait inferencepipeline/demo --for=condition=Ready --timeout="$WAIT"

  say "scale to 2 groups"
  "${k[@]}" scale inferencepipeline demo --replicas 2
  "${k[@]}" wait inferencepipeline/demo --for=jsonpath='{.status.readyReplicas}'=2 --timeout="$WAIT"
  "${k[@]}" wait inferencepipeline/demo --for=condition=Ready --timeout="$WAIT"

  say "kill a stage pod: its group restarts whole, the other keeps serving"
  local pod
  pod="$("${k[@]}" get pods -l pipeserve.io/pipeline=demo,pipeserve.io/group=0 -o name | tail -n 1)"
  "${k[@]}" delete "$pod" --wait=false
  sleep 5
  "${k[@]}" wait inferencepipeline/demo --for=condition=Ready --timeout="$WAIT"
  "${k[@]}" get inferencepipeline demo

  say "a completion through the router"
  "${k[@]}" port-forward svc/pipeserve-router 18000:8000 >/dev/null 2>&1 &
  local forward=$!
  sleep 3
  local served answer
  served="$(curl -sf --max-time 30 localhost:18000/v1/models | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
  answer="$(curl -sf --max-time 120 localhost:18000/v1/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$served\", \"prompt\": \"Hello\", \"max_tokens\": 8}")"
  kill "$forward"
  echo "$answer"
  "$PY" -c 'import json, sys; a = json.loads(sys.argv[1]); assert a["choices"][0]["finish_reason"] in ("length", "stop"), a' "$answer"
  say "ok"
}

if [[ "$MODE" == dry ]]; then dry_run; else run; fi
