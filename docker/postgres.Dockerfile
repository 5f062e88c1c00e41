# Postgres 15 from Debian 12's postgresql-15 package on the base image (docker/base-image.sh): the test stage's
# stand-in for the official postgres:15 image (docker/compose.test.yaml), which it cannot pull (no registry).
# The same interface: POSTGRES_USER/PASSWORD/DB, PGPORT, PGDATA in a volume at /var/lib/postgresql/data, the
# command `postgres ARGS`. Build with the host network (apt-get needs the Debian mirror):
#   docker build --network host -f docker/postgres.Dockerfile -t idemgate-postgres:local docker
ARG BASE=idemgate-base:bookworm
FROM ${BASE}
# No cluster from the package's postinst: the entrypoint makes one in the data volume on the first start.
RUN mkdir -p /etc/postgresql-common \
 && echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.conf \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data/pgdata
LABEL org.idemgate.stage=postgres
USER postgres
VOLUME /var/lib/postgresql/data
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint"]
CMD ["postgres"]
