# syntax=docker/dockerfile:1.7
# The stage image, CPU: `pipeserve stage` (one stage of a pipeline group; the operator's StatefulSets
# run it with command ["pipeserve", "stage"] and their own args). Build from the repository root:
#   docker build -f docker/stage-cpu.Dockerfile -t pipeserve/stage-cpu:0.1.0 .
# The builder installs pipeserve and its pinned dependencies (constraints.txt; torch's CPU wheel from
# PyTorch's index) into /opt/venv; the runtime copies that venv onto the same slim base (same Python
# path, so the venv's links hold), runs as uid 10001 and has no HEALTHCHECK: Kubernetes probes
# /livez and /readyz.
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
COPY operator operator
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -c constraints.txt \
      --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple .

FROM python:3.11.13-slim-bookworm
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
# HOME and PIPESERVE_HOME under /tmp: the root filesystem is read-only in the pods (an emptyDir at /tmp).
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/tmp PIPESERVE_HOME=/tmp/pipeserve
USER 10001:10001
EXPOSE 8080 50051 29500
ENTRYPOINT ["pipeserve", "stage"]
