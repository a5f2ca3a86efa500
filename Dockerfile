# Docker Space (Hugging Face) for `deltasync demo`: the live page on port 7860.
# Self-contained by default; set the Space variable DELTASYNC_DEMO_FOLLOW=<store URL>
# (hf://... or s3://..., both store extras are installed) and optionally DELTASYNC_SIGNAL_URL
# to follow a trainer that runs elsewhere.
# Builds with BuildKit and with the classic builder (DOCKER_BUILDKIT=0).
# BASE: the image test (scripts/test_space_image.py) builds on a local stand-in for python:3.11-slim.
ARG BASE=python:3.11-slim

# ---- stage 1: this checkout as a wheel, built outside the app dir (no build/ or *.egg-info there)
FROM ${BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deltasync ./deltasync
COPY spaces_demo ./spaces_demo
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# ---- stage 2: the Space
FROM ${BASE}

# DELTASYNC_DEMO_LOOP: a Space runs for days, so when a run is done it starts over after 30 s
ENV DELTASYNC_DEMO_LOOP=30 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Spaces run the container as uid 1000. The app dir is made here, owned by that user: the classic
# builder's WORKDIR would create it root-owned, and the demo writes its store (./deltasync-demo) there.
RUN useradd --create-home --uid 1000 user \
    && install -d -o user -g user /home/user/app
USER 1000
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH
WORKDIR /home/user/app

# CPU-only torch first (the default wheel would pull in CUDA), then the package with its demo extra
# and the store extras (s3: obstore, hf: huggingface_hub + hf-xet) that follower mode opens.
# PIP_FIND_LINKS (unset on a Space) lets the image test hand pip the host's local CPU torch wheel.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
RUN pip install --user --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

COPY --from=wheel --chown=user /dist /tmp/dist
# the local package: its dependency ranges live in pyproject.toml
# hadolint ignore=DL3013
RUN set -- /tmp/dist/deltasync-*.whl \
    && pip install --user --no-cache-dir "$1[demo,s3,hf]" \
    && rm -rf /tmp/dist

EXPOSE 7860
CMD ["deltasync", "demo", "--host", "0.0.0.0", "--port", "7860"]
