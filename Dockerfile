# Builds the binaries the README describes: `chime` and `chime-worker`.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p chime-cli -p chime-worker-cli --bins

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/chime /src/target/release/chime-worker /usr/local/bin/
COPY examples/chime.toml /etc/chime/chime.toml
ENV CHIME_CONFIG=/etc/chime/chime.toml
USER nobody
CMD ["chime-worker", "--listen", "0.0.0.0:9464"]
