# specserve: one image that runs any of the three services by its command
#   docker build -t specserve .                       CPU: torch 2.13.0 (CPU build), as scripts/_venv.sh installs it
#   docker build -t specserve:cuda --build-arg VARIANT=cuda .   torch 2.13.0 (CUDA 12.8 build) + CuPy
# Commands: `specserve gateway`, `specserve draft`, `specserve target` (compose.yaml), or `specserve up`.
# Configuration: the SPECSERVE_* environment variables (docs/flags.md, docs/usage.md); the bundled demo pair is in
# /app/models, the default model directories. Your own models: mount them (e.g. at /models, read-only)
# and set SPECSERVE_TARGET_MODEL, SPECSERVE_DRAFT_MODEL and SPECSERVE_GATEWAY_MODEL (docs/deployment.md).
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Where pip finds torch's build of the variant (cpu, or cu128 for CUDA 12.8).
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# torch first and pinned (its own layer: it is the big one and changes least).
RUN if [ "$VARIANT" = cuda ]; then index="$TORCH_INDEX_CUDA"; else index="$TORCH_INDEX_CPU"; fi \
 && pip install --index-url "$index" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY services services
COPY shared shared
COPY models models
# Editable, as the scripts install it: the bundled models are found next to the code (/app/models).
RUN if [ "$VARIANT" = cuda ]; then extras="[cuda]"; else extras=""; fi \
 && pip install -e ".${extras}" && specserve models unpack

# State the gateway keeps (the profile of the target: budget B, baseline latency) and the shared
# secret compose creates; both are volumes in compose.yaml.
RUN mkdir -p /var/lib/specserve /run/specserve && useradd --system --home /var/lib/specserve specserve \
 && chown specserve /var/lib/specserve /run/specserve
USER specserve
ENV HOME=/var/lib/specserve

# gateway HTTP, draft RPC, target RPC, draft /metrics, target /metrics
EXPOSE 8000 8101 8102 9101 9102
ENTRYPOINT ["specserve"]
CMD ["up", "--host", "0.0.0.0"]
