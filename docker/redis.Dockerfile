# Redis from Debian 12's redis-server package on the base image (docker/base-image.sh): the test stage's
# stand-in for the official redis:7 image (docker/compose.test.yaml), which it cannot pull (no registry); the
# same interface (the command is `redis-server ARGS`). Build with the host network (apt-get needs the mirror):
#   docker build --network host -f docker/redis.Dockerfile -t idemgate-redis:local docker
ARG BASE=idemgate-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
LABEL org.idemgate.stage=redis
USER redis
WORKDIR /var/lib/redis
CMD ["redis-server", "--bind", "127.0.0.1", "--port", "6379", "--save", "", "--appendonly", "no"]
