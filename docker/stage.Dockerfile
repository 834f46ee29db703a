# syntax=docker/dockerfile:1.7
# The stage image, CUDA: `pipeserve stage` on NVIDIA GPUs (one GPU per stage pod: the
# InferencePipeline's resources.limits."nvidia.com/gpu": 1). Build from the repository root:
#   docker build -f docker/stage.Dockerfile -t pipeserve/stage:0.1.0 .
# Python 3.11 comes from the deadsnakes PPA (Ubuntu 24.04 ships 3.12); torch is the pinned
# constraints.txt version from PyPI, whose Linux x86_64 wheel is the CUDA build (it brings its own
# CUDA libraries; the base supplies the driver glue the NVIDIA container runtime expects).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS python
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update -q \
 && apt-get install -y -q --no-install-recommends python3.11 python3.11-venv \
 && apt-get purge -y software-properties-common gpg-agent && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*

FROM python AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY services services
COPY kernels kernels
COPY operator operator
RUN python3.11 -m venv /opt/venv && /opt/venv/bin/pip install -c constraints.txt .

FROM python
# Triton compiles its CUDA launcher (a small C extension) the first time a kernel runs, in the pod:
# it needs a C compiler, the C library headers and Python.h of the interpreter that runs it.
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends gcc libc6-dev python3.11-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 pipeserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pipeserve
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/tmp PIPESERVE_HOME=/tmp/pipeserve
USER 10001:10001
EXPOSE 8080 50051 29500
ENTRYPOINT ["pipeserve", "stage"]
