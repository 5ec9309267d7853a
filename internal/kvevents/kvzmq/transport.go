package kvzmq

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

var (
	// ErrEndpoint: an endpoint that is not tcp://HOST:PORT or ipc://PATH.
	ErrEndpoint = errors.New("kvevents: bad endpoint")
	// ErrClosed: Publish after Close.
	ErrClosed = errors.New("kvevents: publisher closed")
)

// parseEndpoint turns a ZMQ endpoint into a Go network and address. A bind
// may use "*" for all interfaces, as vLLM's default tcp://*:5557 does; a
// connect needs a host.
func parseEndpoint(ep string, bind bool) (network, addr string, err error) {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok || rest == "" {
		return "", "", fmt.Errorf("%w %q: want tcp://HOST:PORT or ipc://PATH", ErrEndpoint, ep)
	}
	switch scheme {
	case "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil {
			return "", "", fmt.Errorf("%w %q: %v", ErrEndpoint, ep, err)
		}
		if host == "*" {
			if !bind {
				return "", "", fmt.Errorf("%w %q: cannot connect to *", ErrEndpoint, ep)
			}
			host = ""
		}
		if port == "" {
			return "", "", fmt.Errorf("%w %q: no port", ErrEndpoint, ep)
		}
		return "tcp", net.JoinHostPort(host, port), nil
	case "ipc":
		return "unix", rest, nil
	}
	return "", "", fmt.Errorf("%w %q: unsupported transport %q", ErrEndpoint, ep, scheme)
}

// BindsEndpoint reports whether vLLM binds its PUB socket on endpoint rather
// than connecting it: when the endpoint holds a wildcard host ("*", "::",
// "0.0.0.0"; vLLM tests substrings, so any IPv6 address written with "::"
// counts) or is ipc:// or inproc://. vLLM connects to any other endpoint
// ("bind stable, connect volatile"), which is how engines reach one bound
// SUB socket (see Listen and PublisherOptions.Connect).
func BindsEndpoint(endpoint string) bool {
	return strings.Contains(endpoint, "*") ||
		strings.Contains(endpoint, "::") ||
		strings.Contains(endpoint, "0.0.0.0") ||
		strings.HasPrefix(endpoint, "ipc://") ||
		strings.HasPrefix(endpoint, "inproc://")
}
