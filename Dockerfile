# syntax=docker/dockerfile:1
# trainguard images, two targets from one build:
#
#   docker build --target services -t trainguard/services:0.1.0 .
#       the control plane (detector, diagnoser, checkpointer, remediator, bridge: `trainguard
#       service NAME`) and the on-call CLI: requirements/services.lock, then the wheel with
#       its `services` extra. No torch. Carries kubectl and the scheduler hooks of
#       deploy/hooks/ for the remediator's isolate/release hooks.
#   docker build --target client -t trainguard/client:0.1.0 .
#       the training side: the trainguard client, `trainguard launch` (the node agent, which
#       runs torchrun) and torch: torch from TORCH_INDEX, requirements/client.lock (the
#       `torch`, `gpu` and `agent` extras, torch left out), then the wheel. CPU torch by
#       default; for CUDA pass
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or build FROM your
#       own training image: `pip install trainguard[torch,gpu,agent]` is all it takes).
#
# The locks are `make lock`'s; the wheel goes in with --no-deps, so an image holds exactly
# what was locked (tests/e2e/test_images.py replays these install lines in fresh venvs).
# Both run as the unprivileged user 10001 (numeric, so runAsNonRoot can check it) and write
# nothing outside /tmp: the chart mounts the root file system read-only.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG KUBECTL_IMAGE=registry.k8s.io/kubectl:v1.32.4

# -- the wheel, built once ----------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${KUBECTL_IMAGE} AS kubectl

# -- what both images share ---------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINGUARD_LOG_FORMAT=json
RUN groupadd --system --gid 10001 trainguard \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/trainguard \
       --create-home --shell /usr/sbin/nologin trainguard

# -- the control plane --------------------------------------------------------------------
FROM base AS services
COPY requirements/services.lock /tmp/requirements/
COPY --from=wheel /wheels /wheels
# Exactly the locked stack, then trainguard itself without resolving anything again.
RUN pip install -r /tmp/requirements/services.lock \
    && pip install --no-deps "$(ls /wheels/trainguard-*.whl)[services]" \
    && pip check \
    && rm -rf /wheels /tmp/requirements \
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
COPY --from=kubectl /bin/kubectl /usr/local/bin/kubectl
COPY --chmod=0755 deploy/hooks/ /opt/trainguard/hooks/
# Services listen on their health/metrics port on every interface inside the pod.
ENV TRAINGUARD_HEALTH_HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/trainguard
ENTRYPOINT ["trainguard"]
CMD ["--help"]

# -- the training side --------------------------------------------------------------------
FROM base AS client
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements/client.lock /tmp/requirements/
COPY --from=wheel /wheels /wheels
# torch from TORCH_INDEX (the lock leaves it out: CPU or CUDA is the builder's choice), then
# the locked rest (the agent's store and metrics included), then trainguard without deps.
RUN pip install --index-url "${TORCH_INDEX}" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}" \
    && pip install -r /tmp/requirements/client.lock \
    && pip install --no-deps "$(ls /wheels/trainguard-*.whl)[torch,gpu,agent]" \
    && pip check \
    && rm -rf /wheels /tmp/requirements \
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
USER 10001:10001
WORKDIR /home/trainguard
ENTRYPOINT ["trainguard"]
CMD ["launch", "--help"]
