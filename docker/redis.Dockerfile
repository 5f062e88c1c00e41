# Redis for docker/compose.yaml, from Debian 12's redis-server package on the base image (docker/base-image.sh);
# no registry needed. Build with the host network (apt-get needs the Debian mirror):
#   docker build --network host -f docker/redis.Dockerfile -t idemgate-redis:local docker
ARG BASE=idemgate-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
LABEL org.idemgate.stage=redis
USER redis
WORKDIR /var/lib/redis
# A filter and replay cache only (Postgres is the authority): nothing is saved.
ENTRYPOINT ["redis-server", "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
CMD ["--bind", "127.0.0.1", "--port", "6379"]
