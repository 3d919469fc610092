# photo-reactor image: the `reactor` CLI (`reactor run`, `reactor worker`, ...) and `rq`, with the
# migrations inside the wheel. Install your handlers' package into it (or mount it on PYTHONPATH).
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY reactor ./reactor
COPY sql ./sql
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN useradd --create-home --uid 10001 reactor
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER reactor
ENTRYPOINT ["reactor"]
CMD ["run"]
