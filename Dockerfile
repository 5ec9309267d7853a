# syntax=docker/dockerfile:1
# kvgate's image: one static binary on distroless, run as a non-root user.
#
#   docker build -t kvgate:dev \
#     --build-arg VERSION="$(git describe --tags --always --dirty)" \
#     --build-arg COMMIT="$(git rev-parse HEAD)" --build-arg DATE="$(git log -1 --format=%cI)" .
#   docker run --rm -p 8080:8080 kvgate:dev --replicas http://vllm-0:8000,http://vllm-1:8000
#   docker run --rm kvgate:dev --check-config --config /etc/kvgate/kvgate.yaml   (with the file mounted)
#
# cmd/kvgate/dockerfile_test.go runs this file's go build and checks its ENTRYPOINT.

FROM golang:1.26 AS build
WORKDIR /src
# Modules first, in their own layer and cache mount: a source change does not download them again.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# .git is not in the build context (.dockerignore), so the toolchain stamps no VCS
# information: the version, commit and commit date come from these (kvgate version).
ARG VERSION=dev
ARG COMMIT=unknown
ARG DATE=unknown
# CGO_ENABLED=0: a static binary (distroless/static has no libc); -trimpath: no
# build-machine paths in it; -s -w: no symbol table (kvgate version still reads the
# build information, which is kept).
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT} -X main.date=${DATE}" \
      -o /out/kvgate ./cmd/kvgate

# distroless/static: CA certificates, /etc/passwd with nonroot (65532), tzdata, no shell.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/kvgate /kvgate
USER 65532:65532
EXPOSE 8080
# --listen :8080 because serve's default (127.0.0.1) is unreachable from outside a
# container. A flag wins over a --config file's listen: to serve on the file's
# address, set the command to /kvgate serve (the Kubernetes Deployment does).
ENTRYPOINT ["/kvgate", "serve", "--listen", ":8080"]
