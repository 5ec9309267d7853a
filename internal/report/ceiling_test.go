package report

import (
	"bytes"
	"strings"
	"testing"
)

// A capacity at the search's ceiling is a lower bound: its cell says "≥",
// a note under the table says why (too short or too light a trace), the
// JSON carries capacity_ceiling, and when every policy is there the
// verdict names no winner and says the same.
func TestCapacityCeilingShown(t *testing.T) {
	atCeiling := func(name string) Run {
		r := goldenRun()
		r.Policy, r.CapacitySpeedup, r.CapacityCeiling = name, fptr(4096), true
		return r
	}
	res := Result{Meta: map[string]any{"slo_ttft_p90": "2s", "capacity_precision": 1.005},
		Runs: []Run{atCeiling("round_robin"), atCeiling("ttft")}}
	var tab bytes.Buffer
	WriteTable(&tab, res)
	if !strings.Contains(tab.String(), "≥ 4096.00x") || !strings.Contains(tab.String(), "≥: the capacity search reached its upper limit") ||
		!strings.Contains(tab.String(), "too short or too light") {
		t.Errorf("table:\n%s", tab.String())
	}
	var js bytes.Buffer
	if err := WriteJSON(&js, res); err != nil || strings.Count(js.String(), `"capacity_ceiling": true`) != 2 {
		t.Errorf("json %v:\n%s", err, js.String())
	}
	v, _ := Decide(res)
	if v.Best != "" || v.Clear() || !strings.HasPrefix(v.Headline, "verdict: none: every policy still meets p90 TTFT ≤ 2s at the capacity "+
		"search's upper limit, 4096.00x") || !strings.Contains(v.Headline, "too short or too light") {
		t.Errorf("verdict %+v", v)
	}

	// One policy at the ceiling, one below it: a winner, by at least so much.
	res.Runs[0].CapacitySpeedup, res.Runs[0].CapacityCeiling = fptr(1024), false
	v, _ = Decide(res)
	if v.Best != "ttft" || !strings.Contains(v.Headline, "ttft has the highest capacity: ≥ 4096.00x") ||
		!strings.Contains(v.Headline, "round_robin 1024.00x (ttft serves at least 4") {
		t.Errorf("verdict %+v", v)
	}
	if s := boundLine(&Bound{OracleTTFTms: &Dist{}, OracleCapacity: fptr(4096), OracleCapacityCeiling: true}); !strings.Contains(s,
		"capacity ≥ 4096.00x (the search's upper limit)") {
		t.Errorf("bound line %q", s)
	}
}
