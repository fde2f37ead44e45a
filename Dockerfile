# loraplex: one image for gateways and engine workers (`loraplex serve` / `loraplex worker`, which runs
# the worker's own command `loraplex-worker`).
#   docker build -t loraplex .
# By default the PyPI torch wheel, which carries CUDA for Linux x86_64, so the same image runs GPU workers
# (with the NVIDIA container toolkit) and the CPU fallback. Build arguments (all optional):
#   BASE_IMAGE        any Debian-like image with python3.11 and its venv module (default python:3.11-slim;
#                     scripts/docker/debian-base.sh makes one from Debian's mirror where no registry is
#                     reachable)
#   TORCH_INDEX_URL   an extra index, e.g. https://download.pytorch.org/whl/cpu for a CPU-only image
# Wheels put in scripts/docker/wheels/ (e.g. a local torch+cpu) are offered to pip before any index, and
# CA certificates (*.crt) put in scripts/docker/ca-certificates/ are trusted by the build (a TLS-inspecting
# proxy). Both folders are empty in git; scripts/docker/build-offline.sh fills them. Works with the classic
# builder (Debian's docker.io 20.10, docker-compose 1.29) and with BuildKit.
ARG BASE_IMAGE=python:3.11-slim

# The dependency list alone, so that an edit elsewhere in pyproject.toml (tool settings, dev extras) keeps
# the cached layer that installs torch: COPY --from is cached by the file's content.
FROM ${BASE_IMAGE} AS requirements
LABEL org.opencontainers.image.title=loraplex
COPY pyproject.toml /tmp/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=loraplex
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/loraplex \
    PATH=/opt/loraplex/bin:$PATH

# A virtualenv: Debian's own python3 refuses system-wide pip installs (PEP 668), python:3.11-slim does not mind.
COPY scripts/docker/ca-certificates/ /tmp/extra-ca/
RUN if ls /tmp/extra-ca/*.crt >/dev/null 2>&1; then \
        cp /tmp/extra-ca/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates >/dev/null; fi \
    && rm -rf /tmp/extra-ca \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
# Dependencies first, so that code changes do not reinstall torch.
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
COPY scripts/docker/wheels/ /tmp/wheels/
RUN pip install --cert /etc/ssl/certs/ca-certificates.crt --find-links /tmp/wheels \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r /tmp/requirements.txt \
    && rm -rf /tmp/wheels /tmp/requirements.txt
COPY pyproject.toml README.md ./
COPY wire ./wire
COPY tokenization ./tokenization
COPY engine ./engine
COPY worker ./worker
COPY kernels ./kernels
COPY adapters ./adapters
COPY grammar ./grammar
COPY policies ./policies
COPY gateway ./gateway
COPY demo ./demo
RUN pip install --no-deps . && rm -rf build *.egg-info

RUN useradd --create-home --uid 10001 loraplex \
    && mkdir -p /data/adapters /models \
    && chown -R loraplex /data
USER loraplex

# Listen on every interface inside the container; the compose network is the private network.
ENV LORAPLEX_HOST=0.0.0.0 \
    LORAPLEX_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 8000 8001
ENTRYPOINT ["loraplex"]
CMD ["serve"]
