# eos-bridge container image (multi-stage).
#
#   docker build -t eos-bridge .
#   docker run -v $PWD/my.toml:/etc/eos-bridge/eos-bridge.toml:ro -p 8080:8080 eos-bridge
#
# Both base images are build arguments, so that machines without a registry can build the same
# file from local images (scripts/container-smoke does that with podman). Nothing else differs
# between such a build and the public one.
#
# With podman or buildah, build with `--format docker`: the OCI image format has no HEALTHCHECK,
# and podman drops it otherwise (with a warning).

ARG BUILDER_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------------------------
# Build stage: a Rust toolchain (>= 1.88) plus what the bundled librdkafka build needs (Cyrus SASL
# for GSSAPI/Kerberos, libcurl for OAUTHBEARER OIDC client credentials).
# ---------------------------------------------------------------------------------------------
FROM ${BUILDER_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive

# The official rust image has all of these except cmake; a local builder image may have all.
# Only what is missing is installed, so a builder that has everything needs no network here.
RUN set -eu; \
    missing=""; \
    for p in gcc g++ make perl pkg-config libssl-dev zlib1g-dev libsasl2-dev libcurl4-openssl-dev cmake; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
      echo "installing build packages:$missing"; \
      apt-get update; \
      apt-get install -y --no-install-recommends $missing; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    cargo --version; rustc --version

WORKDIR /build

# Dependency layer: fetch and compile every dependency (librdkafka included, the slow part) from
# the manifest and lock file alone, against stub sources, so that a change under src/ does not
# rebuild them. This layer is only a cache: if it cannot be built (say a manifest names targets
# whose files are not here), the full build below still compiles everything, and fails loudly.
COPY Cargo.toml Cargo.lock ./
RUN set -u; \
    mkdir -p src; echo 'fn main() {}' > src/main.rs; : > src/lib.rs; \
    if cargo fetch --locked && cargo build --release --locked; then \
      cargo clean --release --locked -p eos-bridge; \
    else \
      echo "NOTE: dependency cache layer not built; the full build below compiles everything"; \
    fi; \
    rm -rf src

# The real build (no `failpoints` feature: release builds leave the crash points out). The whole
# context (less .dockerignore), not only src/: a manifest may name targets or a build script
# elsewhere; only this last step reruns when any file changes.
COPY . .
RUN set -eu; \
    touch src/main.rs src/lib.rs; \
    cargo build --release --locked; \
    install -D -m 0755 target/release/eos-bridge /out/eos-bridge; \
    /out/eos-bridge --version

# ---------------------------------------------------------------------------------------------
# Runtime stage: slim Debian, the shared libraries the binary links (OpenSSL 3, zlib, Cyrus SASL
# with its GSSAPI plugin for Kerberos, libcurl for OIDC token requests) and CA certificates for
# TLS to the brokers. librdkafka and zstd are linked statically.
# ---------------------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive

RUN set -eu; \
    missing=""; \
    for p in libssl3 zlib1g libsasl2-2 libsasl2-modules-gssapi-mit libcurl4 ca-certificates; do \
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
      echo "installing runtime packages:$missing"; \
      apt-get update; \
      apt-get install -y --no-install-recommends $missing; \
      rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    fi; \
    groupadd --system --gid 10001 eos-bridge; \
    useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/eos-bridge --no-create-home \
      --shell /usr/sbin/nologin eos-bridge; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/eos-bridge; \
    install -d -m 0755 /etc/eos-bridge

COPY --from=build /out/eos-bridge /usr/local/bin/eos-bridge
# The documented example (every key): mount the real configuration over it, or override single
# keys with EOS_BRIDGE__SECTION__KEY variables.
COPY config/eos-bridge.toml /etc/eos-bridge/eos-bridge.toml

# The state directory (sled checkpoints; one process per directory) lives on the volume, in a
# subdirectory the bridge creates, so that a volume's own entries (lost+found) stay apart.
# The API must listen on all interfaces to be reachable from outside the container.
# These variables override the configuration file; set them again at `docker run` to change them.
ENV EOS_BRIDGE__BRIDGE__STATE_DIR=/var/lib/eos-bridge/state \
    EOS_BRIDGE__API__LISTEN=0.0.0.0:8080

LABEL org.opencontainers.image.title="eos-bridge" \
      org.opencontainers.image.description="Exactly-once Kafka bridge" \
      org.opencontainers.image.licenses="Apache-2.0"

# Declared after the directory is made and owned by uid 10001, so a new volume inherits that owner.
VOLUME ["/var/lib/eos-bridge"]
WORKDIR /var/lib/eos-bridge
USER 10001:10001
EXPOSE 8080

# SIGTERM: final checkpoint and commit, exit 0 within shutdown.timeout (30s by default); give the
# container at least that long to stop (docker stop -t 45, terminationGracePeriodSeconds: 45).
STOPSIGNAL SIGTERM

# Liveness over bash's /dev/tcp: bash is in every Debian image, curl is not in the slim one, and
# installing curl would add it and a dozen libraries (and their CVEs) for this alone. The port is
# taken from EOS_BRIDGE__API__LISTEN, so overriding the listen address keeps the check right (it
# connects to 127.0.0.1, so the address must be 0.0.0.0, [::] or 127.0.0.1).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/bin/bash", "-c", "port=${EOS_BRIDGE__API__LISTEN##*:}; exec 3<>/dev/tcp/127.0.0.1/${port:-8080} || exit 1; printf 'GET /health/live HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3; read -r -t 4 _ code _ <&3; [ \"$code\" = 200 ]"]

# Exec form: eos-bridge is PID 1 and gets SIGTERM itself (it installs its own handlers, which PID 1
# needs; it starts no child processes, so it has none to reap). Arguments after the image name
# replace CMD, e.g. `docker run IMAGE checkpoints list --state-dir /var/lib/eos-bridge/state`.
ENTRYPOINT ["/usr/local/bin/eos-bridge"]
CMD ["run", "--config", "/etc/eos-bridge/eos-bridge.toml"]
