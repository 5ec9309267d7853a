package replay

import (
	"time"

	"github.com/kvgate/kvgate/internal/report"
)

// record is a request's report.Record as a run keeps it until its summary:
// 56 bytes where a report.Record takes 144 (a 1M-request replay held
// 144 MB of them beside everything else), the fields the plan's request
// holds (tenant, program, batch) left there, the error kind an index into
// the run's kinds. expand makes the report.Records, the same ones.
type record struct {
	start, ttft, e2e, maxITL time.Duration
	prompt, cached, output   int32
	replica, priority        int32
	kind                     uint16 // 0: no error; else 1 + its index in records.kinds
}

// records are a run's records, by request index.
type records struct {
	recs  []record
	kinds []string          // error kinds, in order of first failure
	kind  map[string]uint16 // kind → its index + 1
}

func newRecords(n int) records { return records{recs: make([]record, n), kind: map[string]uint16{}} }

// set records request i's outcome.
func (rs *records) set(i int, r *report.Record) {
	c := record{start: r.Start, ttft: r.TTFT, e2e: r.E2E, maxITL: r.MaxITL,
		prompt: int32(r.PromptTokens), cached: int32(r.CachedTokens), output: int32(r.OutputTokens),
		replica: int32(r.Replica), priority: int32(r.Priority)}
	if r.Err {
		k, ok := rs.kind[r.ErrKind]
		if !ok {
			rs.kinds = append(rs.kinds, r.ErrKind)
			k = uint16(len(rs.kinds))
			rs.kind[r.ErrKind] = k
		}
		c.kind = k
	}
	rs.recs[i] = c
}

// expand returns the report.Records of the plan's requests: each as set,
// with its request's tenant, program and batch (a request never recorded:
// the zero Record).
func (rs *records) expand(pl *plan) []report.Record {
	out := make([]report.Record, len(rs.recs))
	for i := range rs.recs {
		c := &rs.recs[i]
		if *c == (record{}) {
			continue
		}
		r := &pl.reqs[i]
		out[i] = report.Record{Start: c.start, TTFT: c.ttft, E2E: c.e2e, MaxITL: c.maxITL,
			PromptTokens: int(c.prompt), CachedTokens: int(c.cached), OutputTokens: int(c.output),
			Replica: int(c.replica), Priority: int(c.priority),
			Tenant: r.Tenant, Program: int32(r.Program), Batch: int32(r.Batch)}
		if c.kind > 0 {
			out[i].Err, out[i].ErrKind = true, rs.kinds[c.kind-1]
		}
	}
	return out
}

// reportRecords are the run's report.Records, by request index.
func (vr *virtualRun) reportRecords() []report.Record { return vr.records.expand(vr.plan) }
