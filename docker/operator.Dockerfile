# syntax=docker/dockerfile:1.7
# The operator image: `pipeserve-operator` (kopf; the chart's operator Deployment). Build from the
# repository root:
#   docker build -f docker/operator.Dockerfile -t pipeserve/operator:0.1.0 .
# pipeserve goes in with --no-deps, then exactly what `pipeserve-operator` imports (pinned by
# constraints.txt; their own dependencies come with them), no torch, safetensors or transformers
# (tests/k8s/test_images.py runs the operator's parser and builders under a Python where those
# imports fail):
#   kopf, kubernetes, aiohttp     the handlers, the API client, the liveness endpoint
# The engine flags are checked with `pipeserve stage`'s own parser (pipeserve.stage_flags: the
# typed configs, nothing third-party), not the whole CLI: no FastAPI, uvicorn or prometheus-client.
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
COPY operator operator
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt \
      kopf kubernetes aiohttp \
 && /opt/venv/bin/pip install --no-deps .

FROM python:3.11.13-slim-bookworm
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pipeserve-operator"]
