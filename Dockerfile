# moe-serve in a container: `docker build -t moe-serve .`, then `docker run --gpus all -p 127.0.0.1:8000:8000
# moe-serve` (README.md "Run with Docker" has the whole story: volumes, real models, API key, compose with Open WebUI).
#
# The project is installed by install.sh, exactly as the README installs it: one requirements source
# (pyproject.toml + requirements-nodeps.txt, torch pinned by install.sh's TORCH_SPEC default).
#
# Base image and torch, a matched pair: install.sh's default torch==2.13.0 from PyPI is the CUDA 13.0 build
# (nvidia-cuda-runtime 13.0.96, cuBLAS, cuDNN and NCCL come with it as pip wheels). So the base is CUDA
# 13.0's `base` flavour: the CUDA runtime plus the variables the NVIDIA container toolkit reads, including
# NVIDIA_REQUIRE_CUDA=cuda>=13.0, which stops a too-old driver at `docker run` with a clear message instead
# of a CUDA error at model load. The `runtime` flavour would add a second ~3 GB copy of the libraries the
# wheels already bring. Ubuntu 24.04's python3 is 3.12, for which torch 2.13.0 has wheels.
# Another pair (e.g. a CUDA 12.x build for drivers older than 580) is three build arguments: BASE_IMAGE,
# TORCH_SPEC and PIP_EXTRA_INDEX_URL (README.md, "Other builds").
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

FROM ${BASE_IMAGE} AS builder
ARG DEBIAN_FRONTEND=noninteractive
# empty: install.sh's default
ARG TORCH_SPEC=""
# pip reads it itself: an extra index for TORCH_SPEC, e.g. https://download.pytorch.org/whl/cpu
ARG PIP_EXTRA_INDEX_URL=""
# DL3008: apt versions are not pinned: Ubuntu replaces old versions in its archive with each security update,
# DL3008: so a pin breaks the build within weeks; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/moe-serve
# Dependencies in a layer of their own, so that a code change does not reinstall torch. install.sh installs
# the project in editable mode (as the README does), so empty package folders suffice here; the sources
# copied next are what runs. The pip cache is a BuildKit cache mount: it never enters a layer.
COPY install.sh pyproject.toml README.md requirements-nodeps.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p server engine cache \
 && PYTHON=python3 VENV=/opt/venv bash install.sh
COPY . .
RUN /opt/venv/bin/python -m compileall -q server engine cache

FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
# the uid the server runs as; 1000 is the usual first user of the host, so bind mounts stay writable
# (not UID: bash keeps that name for its own, read-only)
ARG APP_UID=1000
# No pip, no compiler, no package lists: python3 to run the venv, CA certificates for Hugging Face downloads.
# Ubuntu's stock `ubuntu` user holds uid 1000, so it makes way for `moe`.
# DL3008: apt versions are not pinned: Ubuntu replaces old versions in its archive with each security update,
# DL3008: so a pin breaks the build within weeks; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && groupadd --gid "${APP_UID}" moe \
 && useradd --uid "${APP_UID}" --gid moe --create-home --shell /usr/sbin/nologin moe \
 && mkdir -p /data/huggingface /data/state \
 && chown moe:moe /data/huggingface /data/state
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/moe-serve /opt/moe-serve
WORKDIR /opt/moe-serve
# HF_HOME: downloaded models; MOE_SERVE_CACHE_DIR: the built-in demo model, built once; MOE_SERVE_STATE_DIR:
# the per-user state folder (the EAMC files). All three live on the two volumes, so a new container starts warm.
# MOE_SERVE_HOST/PORT as variables, not flags: a flag would shadow `-e MOE_SERVE_HOST=...` (flag > environment),
# while a variable still beats a --config preset's `host: 127.0.0.1` (environment > YAML).
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/huggingface \
    MOE_SERVE_CACHE_DIR=/data/huggingface/moe-serve \
    MOE_SERVE_STATE_DIR=/data/state \
    MOE_SERVE_HOST=0.0.0.0 \
    MOE_SERVE_PORT=8000
VOLUME ["/data/huggingface", "/data/state"]
# numeric, so that a runtime (Kubernetes runAsNonRoot) can tell it is not root
USER ${APP_UID}:${APP_UID}
EXPOSE 8000
# /health is 503 while the model loads (a first start may download tens of GB), 200 once it serves.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60m --retries=3 \
    CMD ["python", "/opt/moe-serve/docker/healthcheck.py"]
# Flags given to `docker run IMAGE ...` are appended, e.g. `--config configs/mixtral-8x7b-24gb.yaml`.
ENTRYPOINT ["moe-serve"]
