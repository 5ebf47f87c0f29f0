# syntax=docker/dockerfile:1
#
# The wakebus image: one static-ish binary on Debian slim, run as a non-root
# user. Every subcommand is the entrypoint's argument:
#
#   docker build -t wakebus .
#   docker run --rm -e NATS_URL=nats://nats:4222 wakebus worker --executor echo
#
# A worker running the command executor needs an init as PID 1 (`docker run
# --init`, `init: true` in compose): wakebus does not reap the processes a
# task program leaves behind, and their zombies would make each such task
# wait out its kill grace.
#
# docker-compose.yml builds and runs it against a 3-node NATS cluster.

FROM rust:1-bookworm AS builder
# Cargo features to build with: `--build-arg FEATURES=otel` for the
# OpenTelemetry export (docs/OPERATIONS.md).
ARG FEATURES=""
# The commit the version reports (`0.1.0+g<commit>`): the build context has
# no .git. `--build-arg WAKEBUS_BUILD_COMMIT=$(git rev-parse --short=12 HEAD)`.
ARG WAKEBUS_BUILD_COMMIT=""
WORKDIR /src
COPY . .
# The caches keep crates and build artefacts between builds; the binary is
# copied out of the cached target directory so the next stage can take it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    WAKEBUS_BUILD_COMMIT="$WAKEBUS_BUILD_COMMIT" \
    cargo build --release --locked --bin wakebus --features "$FEATURES" \
    && install -D -m 0755 target/release/wakebus /out/wakebus

FROM debian:bookworm-slim
# ca-certificates: TLS to NATS and to the session API.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 wakebus \
    && useradd --system --uid 10001 --gid wakebus --create-home \
       --home-dir /home/wakebus --shell /usr/sbin/nologin wakebus
COPY --from=builder /out/wakebus /usr/local/bin/wakebus
USER 10001:10001
WORKDIR /home/wakebus
ENTRYPOINT ["wakebus"]
CMD ["--help"]
