# syntax=docker/dockerfile:1
#
# kvrouterd container image.
#
#   docker build -t kvrouterd:0.1.0 .
#   docker run --read-only -p 50051:50051 -p 9464:9464 kvrouterd:0.1.0
#   docker run --read-only -p 50051:50051 -v $PWD/kvrouterd.yaml:/etc/kvrouterd/config.yaml:ro kvrouterd:0.1.0
#
# Two stages: "build" turns this checkout into a wheel and installs it (with its PyPI
# dependencies) into a virtualenv; "runtime" is the same slim base with only that virtualenv,
# run as an unprivileged numeric user. The root filesystem can be mounted read-only: nothing
# is written at run time (bytecode is compiled at build time, logs go to stdout).
#
# Configuration: KVROUTERD_CONFIG names the YAML file, /etc/kvrouterd/config.yaml: the image's
# own (metrics on 9464, nothing else) unless one is mounted over it; the Helm chart mounts a
# ConfigMap and names it with --config. KVROUTERD_* variables override single settings, and
# the CMD's flags win over both. Kubernetes ignores HEALTHCHECK: the chart uses native
# gRPC liveness/readiness probes against the same standard health service.

# Python 3.11.14 on Debian bookworm, pinned by exact tag and by the digest of its
# multi-architecture index, so a rebuild gets the same base.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
# Optional extras of the kvrouterd package baked into the image ("" = none). "tokenizer" lets
# the Envoy ext_proc path tokenize prompts with a mounted tokenizer.json; "discovery" installs
# the Kubernetes client that discovery.kubernetes (the chart's pod discovery) runs on.
ARG KVROUTERD_EXTRAS=tokenizer,discovery

FROM ${PYTHON_IMAGE} AS build
ARG KVROUTERD_EXTRAS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# A C compiler for the native fast path (kvrouterd/index/_native.c); only this stage has it,
# the runtime stage gets the compiled wheel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Only what the wheel is built from, and the lock it installs with; see .dockerignore for
# what never enters the context.
COPY pyproject.toml README.md constraints.txt ./
COPY kvrouterd ./kvrouterd
RUN python -m pip wheel --no-deps --wheel-dir /wheels .
RUN python -m venv /opt/kvrouterd
# The wheel built above, never a kvrouterd from PyPI: the file path is the requirement. Every
# dependency at the exact version constraints.txt pins (`make constraints` re-resolves it), so
# a rebuild installs the same modules whatever the day.
RUN /opt/kvrouterd/bin/python -m pip install --constraint constraints.txt "$(echo /wheels/kvrouterd-*.whl)${KVROUTERD_EXTRAS:+[$KVROUTERD_EXTRAS]}"
RUN /opt/kvrouterd/bin/kvrouterd --help
# The extension is optional to the build (pure Python still works) but not to this image.
# (-P: import the installed package, not the sources in the working directory.)
RUN /opt/kvrouterd/bin/python -P -c "from kvrouterd.index import native; assert native.module is not None, native.status"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvrouterd" \
      org.opencontainers.image.description="KV-cache-aware router for LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvrouterd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvrouterd
COPY --from=build /opt/kvrouterd /opt/kvrouterd
# The image's own config file: Prometheus /metrics on 0.0.0.0:9464, which the header's
# `-p 9464:9464` reaches. A file mounted over it, or another named by --config (as the Helm
# chart does) or KVROUTERD_CONFIG, replaces it; KVROUTERD_METRICS_LISTEN overrides the setting.
RUN mkdir -p /etc/kvrouterd && printf 'metrics:\n  listen: "0.0.0.0:9464"\n' > /etc/kvrouterd/config.yaml
ENV PATH=/opt/kvrouterd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVROUTERD_LOG_FORMAT=json \
    KVROUTERD_CONFIG=/etc/kvrouterd/config.yaml
USER 10001:10001
# 50051: gRPC (KVRouter, grpc.health.v1, reflection); 9464: Prometheus /metrics
EXPOSE 50051 9464
# The check reads the daemon's own command line, KVROUTERD_* variables and config file from
# /proc, so it dials whatever address the daemon listens on, over TLS (mTLS) when the daemon
# serves TLS; `docker run --health-cmd "python -m kvrouterd.server.healthcheck --server-name
# NAME"` when the certificate does not name 127.0.0.1 (kvrouterd/server/healthcheck.py).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-m", "kvrouterd.server.healthcheck"]
ENTRYPOINT ["kvrouterd"]
CMD ["serve", "--listen", "0.0.0.0:50051"]
