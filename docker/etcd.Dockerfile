# etcd for the compose cluster's HA masters, from Debian's etcd-server package: the official etcd
# images live on registries (gcr.io, quay.io) that are not reachable everywhere, while every Debian
# mirror is. FROM the same BASE as the kvstore image, so the two share its layers.
#
#   docker build -f docker/etcd.Dockerfile -t kvstore-etcd docker
#
# Any Debian-based BASE with apt works (python:3.x-slim, debian:bookworm-slim, the test's mmdebstrap
# base); elsewhere, use an official etcd image in compose.yaml instead (KVSTORE_ETCD_IMAGE).
ARG BASE=python:3.12-slim
FROM ${BASE}
RUN set -eu; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update; \
    apt-get install -y --no-install-recommends etcd-server; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    mkdir -p /var/lib/etcd; \
    chown etcd:etcd /var/lib/etcd; \
    chmod 0700 /var/lib/etcd; \
    etcd --version
USER etcd
WORKDIR /var/lib/etcd
VOLUME ["/var/lib/etcd"]
EXPOSE 2379 2380
# /health answers {"health":"true"} once the member serves; bash's /dev/tcp needs no client tool.
HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/2379 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q '\"health\":\"true\"' <&3"]
ENTRYPOINT ["etcd"]
CMD ["--data-dir", "/var/lib/etcd/data"]
