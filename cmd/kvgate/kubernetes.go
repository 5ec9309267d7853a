//go:build !nokubernetes

package main

// Kubernetes discovery (discovery: {kubernetes: ...}) registers itself
// when linked, as Prometheus links each service-discovery plugin: on by
// default, left out by `go build -tags nokubernetes` (about 25 MB less of
// binary), which then refuses that configuration, naming the tag.
import _ "github.com/kvgate/kvgate/internal/discovery/kubernetes"
