# Operator image: kopf + kubernetes client + the planning core. No torch.
# Build:  docker build -t moe-operator:0.1.0 .
# Build arguments (docs/install.md "Building the images"): BASE_IMAGE, any Python 3.11 image
# with pip first on PATH (default: the official slim one); PIP_INDEX_URL / PIP_FIND_LINKS /
# PIP_NO_INDEX for a package mirror or an offline wheelhouse (they are pip's own variables).
ARG BASE_IMAGE=python:3.11.11-slim-bookworm
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
# The product packages only: the dev package (operator/dev: local cluster, demo, fake NVML,
# fault injection) stays out of the image.
COPY operator/moejob_operator/ operator/moejob_operator/
COPY operator/moe_contracts/ operator/moe_contracts/
COPY trainer_image/moe_trainer/ trainer_image/moe_trainer/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
LABEL org.opencontainers.image.title="moe-operator" \
      org.opencontainers.image.description="Kubernetes operator for DeepSpeed ZeRO-3 Mixture-of-Experts training"
# Dependencies first, in their own layer (as pyproject.toml lists them: the core + the operator
# extra, no torch): a change to the project's code rebuilds only the layers below this one.
# The constraints pin every transitive version verified together.
COPY pyproject.toml constraints.txt /tmp/moe/
RUN python3 -c "import tomllib; p = tomllib.load(open('/tmp/moe/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator']))" > /tmp/moe/requirements.txt \
    && pip install --no-cache-dir -c /tmp/moe/constraints.txt -r /tmp/moe/requirements.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir -c /tmp/moe/constraints.txt "$(ls /wheels/moe_operator-*.whl)[operator]" \
    && rm -rf /wheels /tmp/moe \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin moe
USER 10001:10001
ENV PYTHONUNBUFFERED=1
EXPOSE 8080 9090
ENTRYPOINT ["moectl", "operator"]
