package report

import (
	"bytes"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestWriteTable(t *testing.T) {
	rr := goldenRun()
	rr.Policy = "round_robin"
	rr.TTFTms.P99 = 12345.678
	withCap := goldenRun()
	withCap.CapacitySpeedup = fptr(3.456)

	tests := []struct {
		name       string
		res        Result
		header     []string
		rows       [][]string // expected cells, in order
		boundLine  string     // "" = none expected
		noCapacity bool
	}{
		{
			name:   "bench",
			res:    Result{Runs: []Run{goldenRun(), rr}},
			header: []string{"policy", "ttft p50 ms", "ttft p90 ms", "ttft p99 ms", "itl p50 ms", "e2e p50 ms", "req/s", "out tok/s", "hit %", "imbalance", "errors"},
			rows: [][]string{
				{"ttft", "100.0", "250.2", "400.0", "9.5", "2000.0", "12.50", "2500", "62.5", "1.20", "2"},
				{"round_robin", "100.0", "250.2", "12345.7", "9.5", "2000.0", "12.50", "2500", "62.5", "1.20", "2"},
			},
			noCapacity: true,
		},
		{
			name:   "replay with capacity and bound",
			res:    Result{Bound: &Bound{PrefixReuse: 0.8123, MergedLRU: 0.7}, Runs: []Run{rr, withCap}},
			header: []string{"policy", "ttft p50 ms", "ttft p90 ms", "ttft p99 ms", "itl p50 ms", "e2e p50 ms", "req/s", "out tok/s", "hit %", "imbalance", "errors", "hit/merged", "capacity"},
			rows: [][]string{
				// hit/merged: 62.5% of a 70% bound = 89.3%.
				{"round_robin", "100.0", "250.2", "12345.7", "9.5", "2000.0", "12.50", "2500", "62.5", "1.20", "2", "89.3", "-"},
				{"ttft", "100.0", "250.2", "400.0", "9.5", "2000.0", "12.50", "2500", "62.5", "1.20", "2", "89.3", "3.46x"},
			},
			boundLine: "hit-rate bounds: prefix reuse 81.2% (unbounded cache), merged LRU 70.0% (one LRU with the fleet's capacity)",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			WriteTable(&b, tt.res)
			lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
			want := 1 + len(tt.rows)
			if tt.boundLine != "" {
				want++
			}
			if len(lines) != want {
				t.Fatalf("got %d lines, want %d:\n%s", len(lines), want, b.String())
			}
			// Aligned: every table line has the header's width (the last column is
			// right-aligned), and each cell ends at the column's right edge.
			width := utf8.RuneCountInString(lines[0])
			for _, l := range lines[:1+len(tt.rows)] {
				if utf8.RuneCountInString(l) != width {
					t.Errorf("line width %d, header %d:\n%s", utf8.RuneCountInString(l), width, b.String())
				}
			}
			if got := splitCells(lines[0], tt.header); strings.Join(got, "|") != strings.Join(tt.header, "|") {
				t.Errorf("header = %q, want %q", got, tt.header)
			}
			for i, row := range tt.rows {
				if got := strings.Fields(lines[1+i]); strings.Join(got, "|") != strings.Join(row, "|") {
					t.Errorf("row %d = %q, want %q", i, got, row)
				}
			}
			// Right alignment: the end of each figure lines up with the end of its header.
			for i, h := range tt.header[1:] {
				end := strings.Index(lines[0], h) + len(h)
				for r, row := range tt.rows {
					cell := row[i+1]
					if lines[1+r][end-len(cell):end] != cell {
						t.Errorf("row %d column %q not right-aligned:\n%s", r, h, b.String())
					}
				}
			}
			if tt.boundLine != "" && lines[len(lines)-1] != tt.boundLine {
				t.Errorf("bound line = %q, want %q", lines[len(lines)-1], tt.boundLine)
			}
			if tt.noCapacity && strings.Contains(b.String(), "capacity") {
				t.Errorf("capacity column without capacity:\n%s", b.String())
			}
		})
	}
}

// splitCells finds the header names in order in line (they contain spaces).
func splitCells(line string, names []string) []string {
	var got []string
	rest := line
	for _, n := range names {
		i := strings.Index(rest, n)
		if i < 0 {
			return got
		}
		got = append(got, n)
		rest = rest[i+len(n):]
	}
	return got
}
