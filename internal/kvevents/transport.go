package kvevents

import (
	"encoding/binary"
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
	// ErrFrames: a ZMQ message that is not [topic, 8-byte seq, payload].
	ErrFrames = errors.New("kvevents: bad message frames")
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

// seqFrame is the 8-byte big-endian sequence frame.
func seqFrame(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// EncodeFrames builds the three ZMQ frames vLLM sends for one batch.
func EncodeFrames(topic string, seq uint64, b Batch, f Form) ([][]byte, error) {
	payload, err := Encode(b, f)
	if err != nil {
		return nil, err
	}
	return [][]byte{[]byte(topic), seqFrame(seq), payload}, nil
}

// DecodeFrames parses the frames of one received ZMQ message.
func DecodeFrames(frames [][]byte) (Message, error) {
	topic, seq, payload, err := splitFrames(frames)
	if err != nil {
		return Message{}, err
	}
	b, err := Decode(payload)
	if err != nil {
		return Message{Topic: topic, Seq: seq}, err
	}
	return Message{Topic: topic, Seq: seq, Batch: b}, nil
}

func splitFrames(frames [][]byte) (topic string, seq uint64, payload []byte, err error) {
	if len(frames) != 3 {
		return "", 0, nil, fmt.Errorf("%w: %d frames, want [topic, seq, payload]", ErrFrames, len(frames))
	}
	if len(frames[1]) != 8 {
		return "", 0, nil, fmt.Errorf("%w: sequence frame of %d bytes, want 8", ErrFrames, len(frames[1]))
	}
	return string(frames[0]), binary.BigEndian.Uint64(frames[1]), frames[2], nil
}
