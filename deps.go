//go:build tools

// Package kvgate pins the module's chosen dependencies (DESIGN.md) so that
// go.mod keeps them before every package that uses them exists. A package
// that nothing uses yet (go-redis, until the shared-index issue) is not
// pinned: it is added with its first import. Nor is the OpenAI client
// (openai-go), a test-only dependency confined to internal/gateway's
// e2e_test.go, whose import is what keeps it in go.mod.
package kvgate

import (
	_ "github.com/cespare/xxhash/v2"
	_ "github.com/go-zeromq/zmq4"
	_ "github.com/hashicorp/golang-lru/v2"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/prometheus/common/expfmt"
	_ "github.com/schollz/progressbar/v3"
	_ "github.com/vmihailenco/msgpack/v5"
	_ "github.com/zeebo/xxh3"
	_ "go.uber.org/goleak"
	_ "gonum.org/v1/plot"
	_ "pgregory.net/rapid"
	_ "sigs.k8s.io/yaml"
)
