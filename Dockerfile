# loraplex: one image for gateways and engine workers (`loraplex serve` / `loraplex worker`, which runs
# the worker's own command `loraplex-worker`).
#   docker build -t loraplex .
# The PyPI torch wheel carries CUDA for Linux x86_64, so the same image runs GPU workers (with the
# NVIDIA container toolkit) and the CPU fallback.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first, so that code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p wire tokenization engine worker kernels adapters grammar policies gateway demo \
    && pip install . \
    && pip uninstall -y loraplex
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
RUN pip install --no-deps .

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
