package main

// Kubernetes discovery (discovery: {kubernetes: ...}) registers itself
// when linked; a build without it refuses that configuration, naming the
// build tag.
import _ "github.com/kvgate/kvgate/internal/discovery/kubernetes"
