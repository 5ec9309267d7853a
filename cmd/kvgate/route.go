package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/kvgate/kvgate/internal/policy"
)

// routeInput is the seed function's input (DESIGN.md contract).
type routeInput struct {
	Requests      *[]routeRequest `json:"requests"`
	NumReplicas   *int            `json:"num_replicas"`
	CacheCapacity *int            `json:"cache_capacity"`
}

type routeRequest struct {
	PrefixHash json.RawMessage `json:"prefix_hash"`
}

const maxRouteInput = 256 << 20

// routeFlags is `kvgate route`, which has no flags: its input is JSON on stdin.
type routeFlags struct{}

func (routeFlags) register(fs *flag.FlagSet) {
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `Usage: kvgate route < input.json

Reads {"requests": [{"prefix_hash": "a"}, ...], "num_replicas": N, "cache_capacity": C}
and writes {"assignments": [...], "cache_hits": H, "hit_ratio": R}.

Each replica keeps an LRU of C prefix hashes and a count of requests. A request
goes to the least loaded replica holding its hash (a hit; the hash becomes most
recent), else to the least loaded replica, which inserts it (evicting its least
recent hash when full). Ties go to the lowest index. hit_ratio = hits / requests,
rounded to 4 decimals.
`)
	}
}

func (routeFlags) run(_ context.Context, inv invocation) error {
	stdin, stdout := inv.stdin, inv.stdout
	data, err := io.ReadAll(io.LimitReader(stdin, maxRouteInput+1))
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	if len(data) > maxRouteInput {
		return fmt.Errorf("input larger than %d MiB", maxRouteInput>>20)
	}
	hashes, replicas, capacity, err := parseRouteInput(data)
	if err != nil {
		return err
	}
	res, err := policy.Route(hashes, replicas, capacity)
	if err != nil {
		return err
	}
	_, err = io.WriteString(stdout, formatRoute(res)+"\n")
	return err
}

func parseRouteInput(data []byte) ([]string, int, int, error) {
	var in routeInput
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return nil, 0, 0, fmt.Errorf("input is not the expected JSON object: %v", err)
	}
	if dec.More() {
		return nil, 0, 0, fmt.Errorf("input has data after the JSON object")
	}
	switch {
	case in.Requests == nil:
		return nil, 0, 0, fmt.Errorf(`input lacks "requests"`)
	case in.NumReplicas == nil:
		return nil, 0, 0, fmt.Errorf(`input lacks "num_replicas"`)
	case in.CacheCapacity == nil:
		return nil, 0, 0, fmt.Errorf(`input lacks "cache_capacity"`)
	}
	hashes := make([]string, len(*in.Requests))
	for i, r := range *in.Requests {
		raw := bytes.TrimSpace(r.PrefixHash)
		if len(raw) == 0 || string(raw) == "null" {
			return nil, 0, 0, fmt.Errorf("requests[%d] lacks a prefix_hash", i)
		}
		var s string
		if raw[0] == '"' {
			if err := json.Unmarshal(raw, &s); err != nil {
				return nil, 0, 0, fmt.Errorf("requests[%d].prefix_hash: %v", i, err)
			}
			s = "s" + s
		} else {
			// A number or other JSON value: keyed by its JSON text, distinct from strings.
			var v any
			if err := json.Unmarshal(raw, &v); err != nil {
				return nil, 0, 0, fmt.Errorf("requests[%d].prefix_hash: %v", i, err)
			}
			s = "j" + string(raw)
		}
		hashes[i] = s
	}
	return hashes, *in.NumReplicas, *in.CacheCapacity, nil
}

// formatRoute writes the answer as the contract shows it (Python's
// json.dumps layout: ", " and ": " separators, hit_ratio always a float).
func formatRoute(res policy.RouteResult) string {
	var sb strings.Builder
	sb.WriteString(`{"assignments": [`)
	for i, a := range res.Assignments {
		if i > 0 {
			sb.WriteString(", ")
		}
		sb.WriteString(strconv.Itoa(a))
	}
	sb.WriteString(`], "cache_hits": `)
	sb.WriteString(strconv.Itoa(res.CacheHits))
	sb.WriteString(`, "hit_ratio": `)
	f := strconv.FormatFloat(res.HitRatio, 'f', -1, 64)
	if !strings.ContainsAny(f, ".e") {
		f += ".0"
	}
	sb.WriteString(f)
	sb.WriteString("}")
	return sb.String()
}
