# syntax=docker/dockerfile:1.7
# The router image: `pipeserve router` (the chart's router Deployment: --discover kubernetes). It
# needs the tokenizer files only, never weights. Build from the repository root:
#   docker build -f docker/router.Dockerfile -t pipeserve/router:0.1.0 .
# pipeserve goes in with --no-deps and the router's runtime dependencies are listed here, pinned by
# constraints.txt, plus the k8s extra for discovery. torch is among them for now, as the CPU wheel:
# `import pipeserve` (the package __init__, the offline LLM API) and the CLI's parser (supervisor.up
# -> care.launcher -> ring.group) import it, so `pipeserve router` cannot start without it yet.
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt \
      --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
      torch tokenizers msgspec xxhash numpy jinja2 grpcio protobuf fastapi uvicorn httptools \
      prometheus-client httpx redis safetensors gguf kopf kubernetes \
 && /opt/venv/bin/pip install --no-deps .

FROM python:3.11.13-slim-bookworm
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["pipeserve", "router"]
