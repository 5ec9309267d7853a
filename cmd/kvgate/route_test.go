package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func runCmd(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

func TestRouteContract(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{`{"requests": [{"prefix_hash": "a"}, {"prefix_hash": "b"}], "num_replicas": 3, "cache_capacity": 2}`,
			`{"assignments": [0, 1], "cache_hits": 0, "hit_ratio": 0.0}`},
		{`{"requests": [], "num_replicas": 2, "cache_capacity": 1}`,
			`{"assignments": [], "cache_hits": 0, "hit_ratio": 0.0}`},
		{`{"requests": [{"prefix_hash": "a"}, {"prefix_hash": "a"}], "num_replicas": 1, "cache_capacity": 1}`,
			`{"assignments": [0, 0], "cache_hits": 1, "hit_ratio": 0.5}`},
		{`{"requests": [{"prefix_hash": "a"}, {"prefix_hash": "a"}, {"prefix_hash": "a"}], "num_replicas": 2, "cache_capacity": 2}`,
			`{"assignments": [0, 0, 0], "cache_hits": 2, "hit_ratio": 0.6667}`},
		{`{"requests": [{"prefix_hash": "a"}, {"prefix_hash": "a"}], "num_replicas": 1, "cache_capacity": 5}`,
			`{"assignments": [0, 0], "cache_hits": 1, "hit_ratio": 0.5}`},
		// A number and the string of its digits are different hashes.
		{`{"requests": [{"prefix_hash": 1}, {"prefix_hash": "1"}], "num_replicas": 1, "cache_capacity": 5}`,
			`{"assignments": [0, 0], "cache_hits": 0, "hit_ratio": 0.0}`},
		{`{"requests": [{"prefix_hash": "a"}, {"prefix_hash": "a"}], "num_replicas": 1, "cache_capacity": 1}` + "\n",
			`{"assignments": [0, 0], "cache_hits": 1, "hit_ratio": 0.5}`},
	}
	for _, tc := range tests {
		code, out, errs := runCmd(t, tc.in, "route")
		if code != 0 || strings.TrimSpace(out) != tc.want {
			t.Errorf("in %s\n got %d %q %q\nwant %s", tc.in, code, out, errs, tc.want)
		}
	}
}

func TestRouteBadInput(t *testing.T) {
	for _, in := range []string{
		``, `[]`, `{"requests": [], "num_replicas": 0, "cache_capacity": 1}`,
		`{"requests": [], "num_replicas": 1, "cache_capacity": -1}`,
		`{"requests": [{"prefix_hash": "a"}], "num_replicas": 1}`,
		`{"num_replicas": 1, "cache_capacity": 1}`,
		`{"requests": [{}], "num_replicas": 1, "cache_capacity": 1}`,
		`{"requests": [], "num_replicas": 1, "cache_capacity": 1, "extra": 1}`,
		`{"requests": [], "num_replicas": "2", "cache_capacity": 1}`,
		`{"requests": [], "num_replicas": 1, "cache_capacity": 1} {}`,
	} {
		code, out, errs := runCmd(t, in, "route")
		if code == 0 || out != "" || errs == "" {
			t.Errorf("input %q: code %d out %q err %q", in, code, out, errs)
		}
	}
}

func TestVerbs(t *testing.T) {
	if code, _, errs := runCmd(t, "", "nosuch"); code != 2 || !strings.Contains(errs, "unknown command") {
		t.Fatalf("unknown verb: %d %q", code, errs)
	}
	if code, out, _ := runCmd(t, "", "--help"); code != 0 || !strings.Contains(out, "route") {
		t.Fatalf("help: %d %q", code, out)
	}
	if code, _, _ := runCmd(t, "", "route", "-h"); code != 0 {
		t.Fatalf("route -h: %d", code)
	}
	if code, _, _ := runCmd(t, "", "route", "extra"); code != 2 {
		t.Fatalf("route extra: %d", code)
	}
}
