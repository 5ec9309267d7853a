package gateway

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// flow_control.bands[].reserve reaches the router: absent, the router's
// default (0); 0, none (the router's negative); n, n.
func TestBandReserveConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kvgate.yaml")
	yaml := `replicas: [{url: "http://10.0.0.1:8000"}]
tenants: [{name: a, api_keys: [k]}]
flow_control:
  bands:
    - {priority: 1, sheddable: true}
    - {priority: 2, sheddable: true, reserve: 0}
    - {priority: 3, sheddable: true, reserve: 2}
`
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := ReadConfig(path)
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		t.Fatal(err)
	}
	fc := cfg.routerFlow(costmodel.MustLookup(costmodel.Default))
	got := []int{}
	for _, b := range fc.Bands {
		got = append(got, b.Reserve)
	}
	if len(got) != 3 || got[0] != 0 || got[1] != -1 || got[2] != 2 {
		t.Fatalf("reserves %v, want [0 -1 2]", got)
	}
}
