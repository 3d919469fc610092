# photo-reactor image: the `reactor` CLI (`reactor run`, `reactor worker`, ...) and `rq`, with the
# migrations inside the wheel. Install your handlers' package into it (or mount it on PYTHONPATH).
# Build args: EXTRAS (e.g. "[otel]") and TRACING_PACKAGES (an SDK distribution and exporter,
# e.g. "opentelemetry-distro opentelemetry-exporter-otlp-proto-http"), for the compose profile
# `tracing`.
FROM python:3.12-slim AS build
ARG EXTRAS=""
ARG TRACING_PACKAGES=""
WORKDIR /src
COPY pyproject.toml README.md ./
COPY reactor ./reactor
COPY sql ./sql
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS}" ${TRACING_PACKAGES}

FROM python:3.12-slim
ARG EXTRAS=""
ARG TRACING_PACKAGES=""
RUN useradd --create-home --uid 10001 reactor
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "photo-reactor${EXTRAS}" \
        ${TRACING_PACKAGES} && rm -rf /wheels
USER reactor
ENTRYPOINT ["reactor"]
CMD ["run"]
