package sim

import (
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// preload puts n long requests (n choices of one call) on the core of the
// given rank, as if they had arrived by HTTP, so that it counts n running
// or waiting requests for as long as a test runs.
func preload(t *testing.T, r *Replica, rank, n int) {
	t.Helper()
	if n == 0 {
		return
	}
	body := `{"model":"sim-llama-8b","prompt":"busy","max_tokens":100000,"ignore_eos":true,"n":` + strconv.Itoa(n) + `}`
	j, err := r.parseJob(prompt.Completion, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	cl, reqs := r.newCall(j)
	if err := r.submit(cl, reqs, rank); err != nil {
		t.Fatal(err)
	}
}

// pump sends a request in the background and runs the engines' steps on
// the fake clock until its answer arrives.
func pump(t *testing.T, clk *clock.Fake, send func() testutil.Response) testutil.Response {
	t.Helper()
	done := make(chan testutil.Response, 1)
	go func() { done <- send() }()
	return finish(t, clk, done)
}

// Rank selection: the X-Data-Parallel-Rank header picks the engine core
// (whatever the loads; any spelling of the name), a rank out of range is a
// 400 naming the header, and without a header (or with one that is not an
// integer, which vLLM ignores) the least loaded core serves, the lowest rank
// on ties. The answer names the rank that served it when there are several.
func TestDataParallelRankSelection(t *testing.T) {
	tests := []struct {
		name   string
		size   int
		loads  []int  // requests preloaded on each core
		header string // "" sends none
		want   int    // serving rank, −1 for a 400
	}{
		{"header 1 on idle cores", 2, []int{0, 0}, "1", 1},
		{"header 0 on the busier core", 2, []int{3, 0}, "0", 0},
		{"header 2 of 3", 3, []int{0, 0, 5}, "2", 2},
		{"header with spaces", 2, []int{0, 0}, " 1 ", 1},
		{"no header, idle: lowest rank", 2, []int{0, 0}, "", 0},
		{"no header, rank 0 busier", 2, []int{2, 1}, "", 1},
		{"no header, rank 1 busier", 2, []int{1, 2}, "", 0},
		{"no header, tie: lowest rank", 3, []int{2, 1, 1}, "", 1},
		{"not an integer: balanced", 2, []int{1, 0}, "one", 1},
		{"out of range", 2, []int{0, 0}, "2", -1},
		{"negative", 2, []int{0, 0}, "-1", -1},
		{"one core: rank 0", 1, []int{0}, "0", 0},
		{"one core: rank 1 out of range", 1, []int{0}, "1", -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			f := startFleet(t, Config{Clock: clk, Seed: 1, DataParallelSize: tc.size})
			r := f.Replicas()[0]
			for rank, n := range tc.loads {
				preload(t, r, rank, n)
			}
			c := testClient(t)
			var hdr []string
			if tc.header != "" {
				hdr = []string{"x-data-parallel-rank", tc.header}
			}
			resp := pump(t, clk, func() testutil.Response {
				return testutil.Post(t, c, r.URL()+"/v1/completions",
					`{"model":"sim-llama-8b","prompt":"hello world","max_tokens":1}`, hdr...)
			})
			if tc.want < 0 {
				checkRankRefused(t, r, resp)
				return
			}
			decodeCompletion(t, resp)
			checkServedBy(t, r, resp, tc.want)
		})
	}
}

// checkRankRefused checks a 400 in OpenAI's shape naming the header, and
// that no engine saw the request.
func checkRankRefused(t *testing.T, r *Replica, resp testutil.Response) {
	t.Helper()
	var e struct {
		Error struct {
			Message, Type string
			Param         *string
		}
	}
	if err := json.Unmarshal([]byte(resp.Body), &e); err != nil || resp.Status != http.StatusBadRequest ||
		e.Error.Type != "invalid_request_error" || e.Error.Param == nil || *e.Error.Param != HeaderDataParallelRank {
		t.Fatalf("status %d body %s, want a 400 naming %s", resp.Status, resp.Body, HeaderDataParallelRank)
	}
	if st := r.Stats(); st.RequestsFinished != 0 || st.PrefixQueries != 0 {
		t.Errorf("a refused request reached an engine: %+v", st)
	}
}

// checkServedBy checks that rank alone finished the request and that the
// answer names it (only with several cores: with one the answer is as it
// was before data parallelism).
func checkServedBy(t *testing.T, r *Replica, resp testutil.Response, rank int) {
	t.Helper()
	for k := range r.DataParallelSize() {
		want := int64(0)
		if k == rank {
			want = 1
		}
		if got := r.EngineStats(k).RequestsFinished; got != want {
			t.Errorf("rank %d finished %d requests, want %d", k, got, want)
		}
	}
	got, ok := resp.Header[HeaderDataParallelRank]
	switch {
	case r.DataParallelSize() == 1 && ok:
		t.Errorf("one core: answer has %s %q", HeaderDataParallelRank, got)
	case r.DataParallelSize() > 1 && (len(got) != 1 || got[0] != strconv.Itoa(rank)):
		t.Errorf("answer header %s %q, want %d", HeaderDataParallelRank, got, rank)
	}
}

// postRank sends a completion of prompt to rank and returns its answer.
func postRank(t *testing.T, c *http.Client, r *Replica, rank int, text string) completion {
	t.Helper()
	resp := testutil.Post(t, c, r.URL()+"/v1/completions",
		`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":2}`,
		HeaderDataParallelRank, strconv.Itoa(rank))
	if got := resp.Header.Get(HeaderDataParallelRank); got != strconv.Itoa(rank) {
		t.Fatalf("served by rank %q, want %d", got, rank)
	}
	return decodeCompletion(t, resp)
}

// Each rank has its own KV cache: a prompt sent twice to rank 1 hits rank
// 1's cache the second time, and is a miss on rank 0.
func TestDataParallelCachePerRank(t *testing.T) {
	cfg := fast()
	cfg.DataParallelSize = 2
	f := startFleet(t, cfg)
	r, c := f.Replicas()[0], testClient(t)
	text := words("dpc", 200)
	if got := postRank(t, c, r, 1, text).Usage.PromptTokensDetails.CachedTokens; got != 0 {
		t.Fatalf("first request cached %d tokens", got)
	}
	if got := postRank(t, c, r, 1, text).Usage.PromptTokensDetails.CachedTokens; got != 192 {
		t.Errorf("second request on rank 1 cached %d tokens, want 192 (12 full blocks of 199)", got)
	}
	if got := postRank(t, c, r, 0, text).Usage.PromptTokensDetails.CachedTokens; got != 0 {
		t.Errorf("rank 0 cached %d tokens of a prompt only rank 1 computed", got)
	}
	if s0, s1 := r.EngineStats(0), r.EngineStats(1); s0.PrefixHits != 0 || s1.PrefixHits != 192 {
		t.Errorf("prefix hits: rank 0 %d, rank 1 %d", s0.PrefixHits, s1.PrefixHits)
	}
}

// perEngineMetrics are the metric families that have one series per
// engine core.
var perEngineMetrics = []string{
	MetricRunning, MetricWaiting, MetricKVUsage, MetricPrefixQueries, MetricPrefixHits, MetricPreemptions,
	MetricPromptTokens, MetricGenTokens, MetricRequestSuccess, MetricTTFT, MetricE2E,
}

// engineSeries counts a family's series by their engine label.
func engineSeries(f *dto.MetricFamily) map[string]int {
	out := map[string]int{}
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "engine" {
				out[l.GetValue()]++
			}
		}
	}
	return out
}

// With two ranks every per-engine metric has a series for engine "0" and
// one for engine "1" (request_success one per finish reason of each), each
// counting its own core's work; cache_config_info stays one per server.
func TestDataParallelMetrics(t *testing.T) {
	cfg := fast()
	cfg.DataParallelSize = 2
	f := startFleet(t, cfg)
	r, c := f.Replicas()[0], testClient(t)
	postRank(t, c, r, 1, words("met", 40))
	fams := scrape(t, c, r.URL())
	for _, name := range perEngineMetrics {
		fam := fams[name]
		if fam == nil {
			t.Errorf("%s missing", name)
			continue
		}
		per := 1
		if name == MetricRequestSuccess {
			per = 3 // stop, length, abort
		}
		if got := engineSeries(fam); len(got) != 2 || got["0"] != per || got["1"] != per {
			t.Errorf("%s: series by engine %v, want %d for each of engine 0 and 1", name, got, per)
		}
	}
	if got := engineSeries(fams[MetricCacheConfig]); len(fams[MetricCacheConfig].GetMetric()) != 1 || got["0"] != 1 {
		t.Errorf("%s: %v, want one series per server", MetricCacheConfig, got)
	}
	for engine, want := range map[string]float64{"0": 0, "1": 40} {
		if v, _ := metricValue(fams, MetricPromptTokens, map[string]string{"engine": engine}); v != want {
			t.Errorf("engine %s: %v prompt tokens, want %v", engine, v, want)
		}
		if v, _ := metricValue(fams, MetricRequestSuccess,
			map[string]string{"engine": engine, "finished_reason": "length"}); v != want/40 {
			t.Errorf("engine %s: %v successes, want %v", engine, v, want/40)
		}
	}
}

// Each data-parallel rank publishes its KV events as vLLM's do: on its own
// publisher, rank k on rank 0's port + k, with its own sequence numbers,
// every batch carrying the rank's data_parallel_rank, in both event forms;
// with one core the batches carry none, as before data parallelism.
func TestDataParallelKVEvents(t *testing.T) {
	for _, form := range []kvevents.Form{kvevents.FormMap, kvevents.FormArray} {
		t.Run(form.String(), func(t *testing.T) {
			cfg := fast()
			cfg.KVEvents, cfg.KVEventsForm, cfg.DataParallelSize = true, form, 2
			f := startFleet(t, cfg)
			r, c := f.Replicas()[0], testClient(t)
			eps := r.KVEndpoints()
			if len(eps) != 2 || eps[0] != r.KVEndpoint() || eps[1] != kvevents.OffsetPort(eps[0], 1) {
				t.Fatalf("endpoints %q (rank 0 %q), want two on consecutive ports", eps, r.KVEndpoint())
			}
			logs := make([]*kvLog, 2)
			for k, ep := range eps {
				logs[k] = subscribeKVAt(t, ep, r.KVTopic())
				logs[k].warmUp(t, func(text string) { postRank(t, c, r, k, text) })
			}
			last := make([]uint64, 2)
			for i, rank := range []int{1, 0, 1, 1, 0} {
				text := words("kv"+strconv.Itoa(i), 48)
				postRank(t, c, r, rank, text)
				// Every batch on rank's publisher is rank's, in its own
				// sequence: the other rank's batches in between take none
				// of its numbers.
				for _, m := range logs[rank].until(t, text) {
					if m.Batch.DataParallelRank == nil || *m.Batch.DataParallelRank != rank || m.Topic != r.KVTopic() {
						t.Fatalf("rank %d's publisher sent a batch of rank %s, topic %q", rank,
							ptrString(m.Batch.DataParallelRank), m.Topic)
					}
					if last[rank] != 0 && m.Seq != last[rank]+1 {
						t.Fatalf("rank %d: seq %d after %d", rank, m.Seq, last[rank])
					}
					last[rank] = m.Seq
				}
			}
			for k, l := range logs {
				select {
				case g := <-l.gaps:
					t.Errorf("rank %d: sequence gap %v", k, g)
				default:
				}
			}
		})
	}
	t.Run("one core", func(t *testing.T) {
		cfg := fast()
		cfg.KVEvents = true
		f := startFleet(t, cfg)
		r, c := f.Replicas()[0], testClient(t)
		if eps := r.KVEndpoints(); len(eps) != 1 || eps[0] != r.KVEndpoint() {
			t.Fatalf("endpoints %q", eps)
		}
		l := subscribeKV(t, r)
		l.warmUp(t, func(text string) { postNoRank(t, c, r, text) })
		text := words("one", 48)
		postNoRank(t, c, r, text)
		if got := l.storedBy(t, text); got != nil {
			t.Fatalf("one core: data_parallel_rank %d, want none", *got)
		}
	})
}

// postNoRank sends a completion without a rank header.
func postNoRank(t *testing.T, c *http.Client, r *Replica, text string) {
	t.Helper()
	decodeCompletion(t, testutil.Post(t, c, r.URL()+"/v1/completions",
		`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1}`))
}

// storedBy reads batches until the one that stores text's last full block
// and returns its data_parallel_rank.
func (l *kvLog) storedBy(t *testing.T, text string) *int {
	t.Helper()
	ms := l.until(t, text)
	return ms[len(ms)-1].Batch.DataParallelRank
}

// until reads batches up to the one that stores text's last full block
// (of model sim-llama-8b) and returns them.
func (l *kvLog) until(t *testing.T, text string) []kvevents.Message {
	t.Helper()
	var out []kvevents.Message
	for {
		m := l.next(t)
		out = append(out, m)
		if stores(m, "sim-llama-8b", text) {
			return out
		}
	}
}

// stores reports whether the batch stores the last full block of text as
// model's.
func stores(m kvevents.Message, model, text string) bool {
	hashes := prompt.ApproxBlockHashes(nil, prompt.RootOf("engine", prompt.Key{Model: model}), text, 16)
	last := hashes[len(hashes)-1]
	for _, ev := range m.Batch.Events {
		if s, ok := ev.(*kvevents.BlockStored); ok && slices.Contains(s.BlockHashes, last) {
			return true
		}
	}
	return false
}

func ptrString(p *int) string {
	if p == nil {
		return "nil"
	}
	return strconv.Itoa(*p)
}

// DataParallelSize is checked by Start.
func TestDataParallelSizeConfig(t *testing.T) {
	for _, n := range []int{-1, MaxDataParallelSize + 1} {
		if _, err := Start(t.Context(), Config{Replicas: 1, DataParallelSize: n}); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("DataParallelSize %d: %v, want ErrInvalidConfig", n, err)
		}
	}
	f := startFleet(t, Config{Seed: 1})
	if n := f.Config().DataParallelSize; n != 1 || f.Replicas()[0].DataParallelSize() != 1 {
		t.Errorf("default data parallel size %d", n)
	}
}
