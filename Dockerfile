# Docker Space (Hugging Face) for `deltasync demo`: the live page on port 7860.
# Self-contained by default; set the Space variable DELTASYNC_DEMO_FOLLOW=<store URL>
# (and optionally DELTASYNC_SIGNAL_URL) to follow a trainer that runs elsewhere.
FROM python:3.11-slim

# DELTASYNC_DEMO_LOOP: a Space runs for days, so when a run is done it starts over after 30 s
ENV DELTASYNC_DEMO_LOOP=30 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Spaces run the container as uid 1000
RUN useradd --create-home --uid 1000 user
USER 1000
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH
WORKDIR /home/user/app

# CPU-only torch first (the default wheel would pull in CUDA), then the package with its demo extra
RUN pip install --user --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY --chown=user pyproject.toml README.md ./
COPY --chown=user deltasync ./deltasync
COPY --chown=user spaces_demo ./spaces_demo
# the local package: its dependency ranges live in pyproject.toml
# hadolint ignore=DL3013
RUN pip install --user --no-cache-dir ".[demo]"

EXPOSE 7860
CMD ["deltasync", "demo", "--host", "0.0.0.0", "--port", "7860"]
