#!/bin/sh
# Entry point of docker/prometheus.Dockerfile: prometheus.yml with compose's host and admin ports.
set -eu
host=${KVSTORE_HOST:-127.0.0.1}
sed -e "s/127.0.0.1:50052/${host}:${KVSTORE_PORT_ADMIN1:-50052}/" \
    -e "s/127.0.0.1:50054/${host}:${KVSTORE_PORT_ADMIN2:-50054}/" \
    /etc/kvstore-prometheus/prometheus.yml > /var/lib/kvstore-prometheus/prometheus.yml
exec prometheus --config.file=/var/lib/kvstore-prometheus/prometheus.yml \
    --storage.tsdb.path=/var/lib/kvstore-prometheus/data \
    --web.listen-address="${host}:${KVSTORE_PORT_PROMETHEUS:-9090}" "$@"
