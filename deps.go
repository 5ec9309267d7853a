//go:build tools

// Package kvgate pins the module's chosen dependencies (DESIGN.md) so that
// go.mod keeps them before every package that uses them exists.
package kvgate

import (
	_ "github.com/cespare/xxhash/v2"
	_ "github.com/go-zeromq/zmq4"
	_ "github.com/hashicorp/golang-lru/v2"
	_ "github.com/openai/openai-go/v3"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/prometheus/common/expfmt"
	_ "github.com/redis/go-redis/v9"
	_ "github.com/schollz/progressbar/v3"
	_ "github.com/vmihailenco/msgpack/v5"
	_ "github.com/zeebo/xxh3"
	_ "go.uber.org/goleak"
	_ "gonum.org/v1/plot"
	_ "pgregory.net/rapid"
	_ "sigs.k8s.io/yaml"
)
