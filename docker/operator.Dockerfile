# syntax=docker/dockerfile:1.7
# The operator image: `pipeserve-operator` (kopf; the chart's operator Deployment). Build from the
# repository root:
#   docker build -f docker/operator.Dockerfile -t pipeserve/operator:0.1.0 .
# pipeserve goes in with --no-deps plus the k8s extra (kopf, kubernetes), pinned by constraints.txt.
# The operator imports pipeserve.care.restarts (stdlib only), but importing any pipeserve module runs
# the package __init__, which imports the offline LLM API and so torch: the CPU wheel is here until
# that import is made lazy.
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt \
      --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
      kopf kubernetes torch tokenizers msgspec xxhash numpy safetensors jinja2 \
 && /opt/venv/bin/pip install --no-deps .

FROM python:3.11.13-slim-bookworm
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pipeserve-operator"]
