# Prometheus with kvstore's alerting rules, from Debian's prometheus package (as etcd.Dockerfile:
# every Debian mirror has it; FROM the same BASE as the kvstore image, so they share its layers).
#
#   docker build -f docker/prometheus.Dockerfile -t kvstore-prometheus docker
#
# The rules are checked at build time (promtool check rules, and their unit tests).
ARG BASE=python:3.12-slim
FROM ${BASE}
RUN set -eu; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update; \
    apt-get install -y --no-install-recommends prometheus; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    mkdir -p /var/lib/kvstore-prometheus; \
    chown prometheus:prometheus /var/lib/kvstore-prometheus
COPY prometheus/ /etc/kvstore-prometheus/
RUN promtool check rules /etc/kvstore-prometheus/alerts.yml \
    && cd /etc/kvstore-prometheus && promtool test rules alerts_test.yml
USER prometheus
WORKDIR /var/lib/kvstore-prometheus
VOLUME ["/var/lib/kvstore-prometheus"]
EXPOSE 9090
# /-/ready answers 200 once the rules are loaded and the first scrapes may run.
HEALTHCHECK --interval=5s --timeout=4s --start-period=20s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/${KVSTORE_HOST:-127.0.0.1}/${KVSTORE_PORT_PROMETHEUS:-9090} && printf 'GET /-/ready HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q ' 200 ' <&3"]
ENTRYPOINT ["/etc/kvstore-prometheus/run.sh"]
