package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// startFleet starts a fleet on ephemeral ports, closed when the test ends.
func startFleet(t testing.TB, cfg Config) *Fleet {
	t.Helper()
	if cfg.Replicas == 0 {
		cfg.Replicas = 1
	}
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return f
}

// testClient has no connection reuse across tests and a bounded timeout.
func testClient(t testing.TB) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

func get(t testing.TB, c *http.Client, url string) testutil.Response {
	t.Helper()
	r, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return testutil.Response{Status: r.StatusCode, Header: r.Header, Body: string(b)}
}

// completion is the non-streamed answer, both kinds.
type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int    `json:"index"`
		Text    string `json:"text"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func decodeCompletion(t testing.TB, r testutil.Response) completion {
	t.Helper()
	if r.Status != http.StatusOK {
		t.Fatalf("status %d: %s", r.Status, r.Body)
	}
	var c completion
	if err := json.Unmarshal([]byte(r.Body), &c); err != nil {
		t.Fatalf("decode %s: %v", r.Body, err)
	}
	return c
}

// sseEvents splits an SSE body into its data payloads.
func sseEvents(t testing.TB, body string) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("not an SSE data line: %q", line)
		}
		out = append(out, data)
	}
	return out
}

// scrape parses a replica's /metrics with the Prometheus text parser.
func scrape(t testing.TB, c *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	r := get(t, c, url+"/metrics")
	if r.Status != http.StatusOK {
		t.Fatalf("/metrics: %d", r.Status)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(r.Body))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams
}

// metricValue is the value of the family's series whose labels include want.
func metricValue(fams map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Histogram != nil:
			return m.Histogram.GetSampleSum(), true
		}
	}
	return 0, false
}

func histCount(fams map[string]*dto.MetricFamily, name string) uint64 {
	f := fams[name]
	if f == nil || len(f.GetMetric()) == 0 || f.GetMetric()[0].Histogram == nil {
		return 0
	}
	return f.GetMetric()[0].Histogram.GetSampleCount()
}

// waitTimer waits until the fake clock has exactly one armed timer and
// returns its offset from now.
func waitTimer(t *testing.T, clk *clock.Fake) time.Duration {
	t.Helper()
	var p []time.Duration
	testutil.Eventually(t, 10*time.Second, "an armed timer", func() bool {
		p = clk.Pending()
		return len(p) == 1
	})
	return p[0]
}

// newFakeClock is the fake wall clock of the replicas under test.
func newFakeClock() *clock.Fake { return clock.NewFake(time.Time{}) }
