# The packaged idemgate under a booted systemd, for the docker stage (tests/docker/run.sh): Debian's systemd as
# PID 1, PostgreSQL 15 and Redis from Debian's packages started by their own units, and the .deb that
# tests/package/build-deb.sh made (copied into the build context as idemgate.deb). No registry: BASE is
# docker/base-image.sh's image. Debian's redis-server unit has PrivateUsers=yes, which cannot set up user
# namespaces in this container (status 217/USER); a drop-in turns it off (idemgate's unit does not use it).
ARG BASE=idemgate-base:bookworm
FROM ${BASE}
COPY idemgate.deb /tmp/idemgate.deb
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      systemd curl postgresql-15 redis-server /tmp/idemgate.deb \
 && rm -rf /var/lib/apt/lists/* /tmp/idemgate.deb \
 && rm -f /usr/sbin/policy-rc.d \
 && mkdir -p /etc/systemd/system/redis-server.service.d \
 && printf '[Service]\nPrivateUsers=no\n' >/etc/systemd/system/redis-server.service.d/no-userns.conf
LABEL org.idemgate.stage=systemd
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
