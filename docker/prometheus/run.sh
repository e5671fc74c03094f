#!/bin/sh
# Entry point of docker/prometheus.Dockerfile: prometheus.yml with compose's host, admin and metrics ports.
set -eu
host=${KVSTORE_HOST:-127.0.0.1}
sed -e "s/127.0.0.1:50052/${host}:${KVSTORE_PORT_ADMIN1:-50052}/" \
    -e "s/127.0.0.1:50054/${host}:${KVSTORE_PORT_ADMIN2:-50054}/" \
    -e "s/127.0.0.1:50061/${host}:${KVSTORE_PORT_NODE1_METRICS:-50061}/" \
    -e "s/127.0.0.1:50062/${host}:${KVSTORE_PORT_NODE2_METRICS:-50062}/" \
    /etc/kvstore-prometheus/prometheus.yml > /var/lib/kvstore-prometheus/prometheus.yml
exec prometheus --config.file=/var/lib/kvstore-prometheus/prometheus.yml \
    --storage.tsdb.path=/var/lib/kvstore-prometheus/data \
    --web.listen-address="${host}:${KVSTORE_PORT_PROMETHEUS:-9090}" "$@"
