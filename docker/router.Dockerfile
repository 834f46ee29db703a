# syntax=docker/dockerfile:1.7
# The router image: `pipeserve router` (the chart's router Deployment: --discover kubernetes). It
# needs the tokenizer files only, never weights. Build from the repository root:
#   docker build -f docker/router.Dockerfile -t pipeserve/router:0.1.0 .
# pipeserve goes in with --no-deps, then exactly what `pipeserve router` imports when it serves
# (pinned by constraints.txt; their own dependencies come with them), no torch, safetensors or
# transformers (tests/k8s/test_images.py runs the router under a Python where those imports fail):
#   fastapi, uvicorn, httptools   the HTTP server (router.app, router.http_guard)
#   prometheus-client             /metrics
#   grpcio, protobuf              the groups' stage 0 (router.upstream, pipeserve.rpc)
#   tokenizers, jinja2            tokenizer.json and the chat template (pipeserve.tokenizer)
#   xxhash                        prefix-affinity block hashes (router.policy)
#   kubernetes                    --discover kubernetes (router.discovery_k8s)
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
COPY operator operator
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt \
      fastapi uvicorn httptools prometheus-client grpcio protobuf tokenizers jinja2 xxhash kubernetes \
 && /opt/venv/bin/pip install --no-deps .

FROM python:3.11.13-slim-bookworm
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["pipeserve", "router"]
