"""Helpers of the chart and image tests: the real helm and kubectl binaries (`make k8s-tools` puts them
in .tools/bin), the chart rendered with `helm template`, and a discovery-only API endpoint for
`kubectl create --dry-run=client`. (Not a conftest.py: without __init__.py files a second conftest
would replace tests/conftest.py as the module `conftest` that other tests import from.)

kubectl's client-side dry run still maps each kind to its resource through the server's discovery
documents, and no API server runs here; `discovery_server` serves just those documents (legacy
discovery: /api, /apis, /api/v1, /apis/<group>/<version>) for the kinds it is given, nothing else
(every other request is a 404), so kubectl really parses, maps and prints every object.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pipeserve"


def _tools_dir() -> Path:
    """This checkout's .tools/bin, else the one beside the venv running the tests (tests/mutants.py runs
    them in a copy of the tree, which has no .tools)."""
    for root in (ROOT, Path(sys.executable).parents[2]):
        if (root / ".tools" / "bin" / "helm").exists():
            return root / ".tools" / "bin"
    return ROOT / ".tools" / "bin"


TOOLS = _tools_dir()


class Tools:
    def __init__(self) -> None:
        self.helm = TOOLS / "helm"
        self.kubectl = TOOLS / "kubectl"

    def run(
        self, *argv: str | Path, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        r = subprocess.run([str(a) for a in argv], input=stdin, capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(
                f"{' '.join(map(str, argv))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )
        return r

    def template(self, *args: str, chart: Path = CHART, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(self.helm, "template", "rel", chart, "--namespace", "ml", *args, check=check)

    def objects(self, *args: str, chart: Path = CHART) -> list[dict]:
        """`helm template` (CRDs included) parsed into objects."""
        out = self.template("--include-crds", *args, chart=chart).stdout
        return [o for o in yaml.safe_load_all(out) if o]


@functools.cache
def k8s_tools() -> Tools:
    """The binaries, checked once per session (they run)."""
    t = Tools()
    for binary in (t.helm, t.kubectl):
        assert binary.exists(), f"{binary} missing: run `make k8s-tools`"
    t.run(t.helm, "version", "--short")
    t.run(t.kubectl, "version", "--client")
    return t


_IRREGULAR = {"Ingress": "ingresses", "NetworkPolicy": "networkpolicies"}


def plural(kind: str) -> str:
    return _IRREGULAR.get(kind, kind.lower() + "s")


def _discovery(objects: list[dict]) -> dict[str, dict]:
    """Path -> JSON document, for the group/versions and kinds of `objects`."""
    by_gv: dict[str, list[dict]] = {}
    for o in objects:
        gv = o["apiVersion"]
        kind = o["kind"]
        namespaced = kind not in (
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
            "Namespace",
        )
        res = {"name": plural(kind), "singularName": kind.lower(), "namespaced": namespaced, "kind": kind}
        res["verbs"] = ["create", "get", "list", "watch", "patch", "update", "delete"]
        if res not in by_gv.setdefault(gv, []):
            by_gv[gv].append(res)
    docs: dict[str, dict] = {
        "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    }
    groups = []
    for gv, resources in by_gv.items():
        path = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        docs[path] = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }
        if gv != "v1":
            group, version = gv.split("/")
            ver = {"groupVersion": gv, "version": version}
            groups.append({"name": group, "versions": [ver], "preferredVersion": ver})
    docs.setdefault(
        "/api/v1", {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": []}
    )
    docs["/apis"] = {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    docs["/version"] = {"major": "1", "minor": "35", "gitVersion": "v1.35.0"}
    return docs


@contextlib.contextmanager
def discovery_server(objects: list[dict], tmp: Path) -> Iterator[Path]:
    """A kubeconfig whose server answers discovery for the kinds of `objects` (for the block's duration)."""
    docs = _discovery(objects)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name for the GET handler
            doc = docs.get(self.path.split("?")[0])
            body = json.dumps(doc if doc is not None else {"kind": "Status", "code": 404}).encode()
            self.send_response(200 if doc is not None else 404)
            self.send_header("Content-Type", "application/json")  # legacy discovery, not aggregated
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp / "kubeconfig"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "namespace": "ml"}}],
                "current-context": "c",
                "users": [],
            }
        )
    )
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()
