package gateway

import (
	"io"
	"net/http"
	"regexp"
	"strconv"
	"testing"

	"github.com/kvgate/kvgate/internal/sim"
)

// /metrics carries each pool's saturation gauge and its parts; requests
// served make its load positive.
func TestPoolSaturationGauge(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2})
	gw := startGateway(t, simConfig("ttft", fl.URLs()...))
	waitHealthy(t, gw)
	read := func() map[string]float64 {
		resp, err := http.Get(gw.srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		out := map[string]float64{}
		for _, m := range regexp.MustCompile(`(?m)^(kvgate_pool_\w+)\{pool="default"\} (\S+)$`).FindAllStringSubmatch(string(b), -1) {
			out[m[1]], _ = strconv.ParseFloat(m[2], 64)
		}
		return out
	}
	first := read()
	for _, k := range []string{"kvgate_pool_saturation", "kvgate_pool_load", "kvgate_pool_capacity"} {
		if _, ok := first[k]; !ok {
			t.Fatalf("no %s{pool=\"default\"} in /metrics: %v", k, first)
		}
	}
	if first["kvgate_pool_capacity"] <= 0 {
		t.Fatalf("capacity %v with two replicas in rotation", first["kvgate_pool_capacity"])
	}
	for range 5 {
		if r, _ := post(t, gw.srv.URL+"/v1/completions", `{"model":"`+sim.DefaultModel+`","prompt":"hello there","max_tokens":8}`); r.StatusCode != 200 {
			t.Fatalf("status %d", r.StatusCode)
		}
	}
	eventually(t, "the load seen", func() bool { m := read(); return m["kvgate_pool_load"] > 0 && m["kvgate_pool_saturation"] > 0 })
}
