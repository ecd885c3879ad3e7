# mleagle server image. The install goes through scripts/install.sh, the same script the README and CI
# use (one source of truth).
#
#   docker build -t mleagle .                                   # CPU (python:3.11-slim, CPU torch)
#   docker run --rm -p 8000:8000 mleagle                        # serves SmolLM2 on 0.0.0.0:8000
#   docker run --rm -p 8000:8000 -e MLEAGLE_API_KEY=secret mleagle
#
# GPU: a CUDA base image and the matching torch wheel index (a CUDA torch build brings Triton), then
# run with --gpus all: device "auto" serves on the GPU in bfloat16 with CUDA graphs.
#   docker build -t mleagle:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm --gpus all -p 8000:8000 mleagle:cuda
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# CUDA base images ship without python: add it (python:* images already have it).
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MLEAGLE_TORCH_VERSION=2.13.0
ARG WARM_CACHE=1
ENV MLEAGLE_CACHE_DIR=/opt/mleagle/cache \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/mleagle/.venv/bin:$PATH

WORKDIR /opt/mleagle
COPY . .
RUN PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL}" MLEAGLE_TORCH_VERSION="${MLEAGLE_TORCH_VERSION}" \
      bash scripts/install.sh
# Dequantise the bundled GGUF once at build time, so a container is healthy seconds after it starts.
RUN if [ "$WARM_CACHE" = 1 ]; then \
      python -c "from mleagle.engine.core.engine import Engine; Engine('smollm2-135m', max_total_tokens=1024)"; \
    fi

RUN useradd --system --home-dir /opt/mleagle --shell /usr/sbin/nologin mleagle \
    && mkdir -p "$MLEAGLE_CACHE_DIR" && chown -R mleagle "$MLEAGLE_CACHE_DIR"
USER mleagle

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"
# Inside the container the server must listen on every interface to be reachable through -p.
ENTRYPOINT ["mleagle", "serve"]
CMD ["--config", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
