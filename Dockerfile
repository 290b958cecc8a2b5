# syntax=docker/dockerfile:1
# The copse control-plane image: operator, planner, router and mock workers, one image with
# different commands (`copse operator run`, `copse planner run`, `copse router run`,
# `copse worker mock`). GPU workers run NVIDIA's TensorRT-LLM image instead (README, Images).
#
#   docker build -t ghcr.io/copse-dev/copse:0.1.0 . && docker push ghcr.io/copse-dev/copse:0.1.0
#   # GB200 trays are arm64 (Grace): build both architectures where mock workers may land there
#   docker buildx build --platform linux/amd64,linux/arm64 -t ghcr.io/copse-dev/copse:0.1.0 --push .

# The full image has the C compiler the router's compiled loops (copse.router._native) need; the
# runtime image below gets only the built wheels.
FROM python:3.11 AS build
WORKDIR /src
# Only what the wheel is built from, so edits elsewhere (tests, docs) keep the layer cached.
COPY pyproject.toml setup.py README.md ./
COPY operator operator
COPY planner planner
COPY router router
COPY workers workers
COPY sim sim
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLCONFIGDIR=/tmp/matplotlib
# UID/GID 10001: the chart's securityContext runs as this user (runAsNonRoot).
RUN groupadd --gid 10001 copse \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin copse
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index /wheels/*.whl
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8080 9090 9464
ENTRYPOINT ["copse"]
CMD ["--help"]
