# mleagle server image. Dependencies go through scripts/install.sh, the same script the README and CI
# use (one source of truth). Built and smoke-tested by scripts/docker_smoke.sh; README "Docker" says
# what was measured.
#
#   docker build -t mleagle .                                   # CPU (python:3.11-slim, CPU torch)
#   docker run --rm -p 8000:8000 -e MLEAGLE_API_KEY mleagle     # serves SmolLM2 on 0.0.0.0:8000
#
# Build arguments:
#   BASE_IMAGE       any Debian/Ubuntu image; python3 is installed with apt if it has none (CUDA bases)
#   PIP_INDEX_URL    the package index (a mirror or proxy); default PyPI
#   TORCH_INDEX_URL  the torch wheel index, searched besides PIP_INDEX_URL; empty: the package index's
#                    own torch (on Linux x86-64 that is the CUDA build, several GB)
#   MLEAGLE_TORCH_VERSION, WARM_CACHE (1: dequantise the bundled GGUF at build time)
# A CA bundle for a TLS-inspecting proxy is a build secret, never a layer:
#   docker build --secret id=pip-cert,src=/path/to/ca.pem ...
# Wheels in a `wheels/` folder of the build context (git-ignored) are installed from first (pip
# --find-links) and are not kept in the image.
#
# GPU: a CUDA build of torch, then run with --gpus all: device "auto" serves on the GPU in bfloat16
# with CUDA graphs. The wheel brings Triton and the CUDA libraries (nvidia-* wheels); the driver comes
# from the host with --gpus. Either a CUDA base and the matching torch index,
#   docker build -t mleagle:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# or the default base and the package index's own torch (on PyPI, 2.13.0+cu130: a CUDA 13 driver):
#   docker build -t mleagle:cuda --build-arg TORCH_INDEX_URL= .
#   docker run --rm --gpus all -p 8000:8000 mleagle:cuda
#
# At run time: MLEAGLE_API_KEY (from the environment only; nothing in the image sets it), MLEAGLE_PORT
# and MLEAGLE_HOST (the HEALTHCHECK reads the same port). SIGTERM (`docker stop`) drains: requests in
# flight finish for up to --shutdown-timeout (30 s), so give `docker stop -t` more than that.
ARG BASE_IMAGE=python:3.11-slim

# --- base: python3 and the unprivileged user, shared by the build and the final stage (the venv made
# in the build stage points at this python).
FROM ${BASE_IMAGE} AS base
# CUDA base images ship without python: add it (python:* images already have it).
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --system --uid 10001 --home-dir /opt/mleagle --shell /usr/sbin/nologin mleagle

# --- build: the venv, by scripts/install.sh (runtime mode: no test dependencies).
FROM base AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MLEAGLE_TORCH_VERSION=2.13.0
WORKDIR /opt/mleagle
COPY . .
# The CA bundle is mounted for this one RUN only. pip keeps no cache (PIP_NO_CACHE_DIR), and pip and
# setuptools leave the venv afterwards: nothing at run time needs them (the editable install's finder
# is a plain module). The torch wheel's C++ test binaries (torch/test, torch/bin but its shared-memory
# manager) and headers (torch/include, for compiling extensions, which this image has no compiler
# for) go too: about 190 MB that serving never opens. Bytecode is compiled here because the final
# image's source is read-only to the user that runs it.
RUN --mount=type=secret,id=pip-cert \
    export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_INDEX_URL MLEAGLE_TORCH_VERSION; \
    if [ -f /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
    if [ -n "$TORCH_INDEX_URL" ]; then export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"; fi; \
    if [ -d wheels ]; then export PIP_FIND_LINKS=/opt/mleagle/wheels; fi; \
    bash scripts/install.sh \
    && .venv/bin/python -m pip uninstall -y -q pip setuptools \
    && t=$(echo .venv/lib/python3*/site-packages/torch) \
    && find "$t/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && rm -rf "$t/test" "$t/include" wheels \
    && .venv/bin/python -m compileall -q -j 0 -x '/\.venv/' /opt/mleagle >/dev/null

# --- final: the venv and the source (editable install), owned by root; the weight cache by the user.
FROM base
ENV MLEAGLE_CACHE_DIR=/opt/mleagle/cache \
    MLEAGLE_HOST=0.0.0.0 \
    MLEAGLE_PORT=8000 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/mleagle/.venv/bin:$PATH
WORKDIR /opt/mleagle
COPY --from=build /opt/mleagle /opt/mleagle
# One layer, so nothing is copied twice (a later chown would copy the whole cache into another layer):
# - Triton, which a CUDA build of torch brings, compiles its CUDA driver module with a C compiler
#   against Python.h when the engine first starts on a GPU, so a CUDA image gets gcc and the headers
#   (the CPU image neither);
# - the bundled GGUF is dequantised once (WARM_CACHE=1): the engine then maps the float32 cache and a
#   container is healthy seconds after it starts. The cache belongs to the user that serves and is
#   readable by all (for a container run with another --user).
ARG WARM_CACHE=1
RUN if python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then \
      pkgs="gcc libc6-dev"; \
      [ -f "$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || pkgs="$pkgs python3-dev"; \
      apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; \
    fi \
    && mkdir -p "$MLEAGLE_CACHE_DIR" \
    && if [ "$WARM_CACHE" = 1 ]; then \
      python -c "from mleagle.engine.core.engine import Engine; Engine('smollm2-135m', max_total_tokens=1024)"; \
    fi \
    && chown -R mleagle:mleagle "$MLEAGLE_CACHE_DIR" && chmod -R a+rX "$MLEAGLE_CACHE_DIR"
USER mleagle

EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('MLEAGLE_PORT', '8000'), timeout=2).status != 200)"]
# Exec form: the daemon is PID 1 and gets docker stop's SIGTERM itself (no shell in between to swallow
# it); it handles SIGTERM and SIGINT, and waits for the engine process it starts.
ENTRYPOINT ["mleagle", "serve"]
CMD ["--config", "smollm2-135m"]
