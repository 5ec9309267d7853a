package epp

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/sim"
)

// sidecar is llm-d's routing sidecar as far as pulls go, in front of one
// sim: it turns the picker's pull headers into the body's
// kv_transfer_params.remote_kv_source (the source named by its sidecar's
// address, which the sidecars map to its sim's: a real sidecar adds its
// --p2p-connector-port instead), strips them, and records what it saw.
type sidecar struct {
	srv   *httptest.Server
	peers map[string]string // sidecar host:port → sim host:port (shared)
	mu    sync.Mutex
	seen  []string // each inference request's pull source header ("" without)
}

func (s *sidecar) serve(w http.ResponseWriter, r *http.Request, sim *url.URL) {
	src, port := r.Header.Get("X-Kv-Cache-Source-Host-Port"), r.Header.Get("X-Kv-Cache-Source-P2p-Port")
	r.Header.Del("X-Kv-Cache-Source-Host-Port")
	r.Header.Del("X-Kv-Cache-Source-P2p-Port")
	if r.Method == http.MethodPost { // not the gateway's probes and scrapes
		s.mu.Lock()
		s.seen = append(s.seen, src)
		s.mu.Unlock()
	}
	if peer, ok := s.peers[src]; ok && r.Method == http.MethodPost {
		host, simPort, _ := net.SplitHostPort(peer)
		if _, err := strconv.Atoi(port); err != nil {
			http.Error(w, "pull without its P2P port header", http.StatusBadRequest)
			return
		}
		var b map[string]any
		raw, _ := io.ReadAll(r.Body)
		if json.Unmarshal(raw, &b) != nil {
			http.Error(w, "not JSON", http.StatusBadRequest)
			return
		}
		p, _ := strconv.Atoi(simPort)
		b["kv_transfer_params"] = map[string]any{"remote_kv_source": map[string]any{
			"kv_request_id": r.Header.Get("X-Request-Id"), "remote_host": host, "remote_port": p}}
		raw, _ = json.Marshal(b)
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(raw)), int64(len(raw))
		r.Header.Set("Content-Length", strconv.Itoa(len(raw)))
	}
	httputil.NewSingleHostReverseProxy(sim).ServeHTTP(w, r)
}

// startSidecars puts a sidecar in front of each of fl's sims; their URLs
// are the replicas' the picker knows.
func startSidecars(t *testing.T, fl *sim.Fleet) ([]*sidecar, []string) {
	t.Helper()
	peers := map[string]string{}
	var scs []*sidecar
	var urls []string
	for _, u := range fl.URLs() {
		target, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		s := &sidecar{peers: peers}
		s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.serve(w, r, target) }))
		t.Cleanup(s.srv.Close)
		peers[strings.TrimPrefix(s.srv.URL, "http://")] = target.Host
		scs, urls = append(scs, s), append(urls, s.srv.URL)
	}
	return scs, urls
}

// Behind the endpoint picker a pull goes as llm-d's p2p-source-producer
// sends it: the source's endpoint in x-kv-cache-source-host-port (and its
// P2P port) for the chosen replica's routing sidecar, which writes
// kv_transfer_params itself. A prompt's second request, sent by the
// policy (round_robin) to the replica that does not hold it, pulls it
// from the one that does: the answer counts the pulled tokens cached and
// X-Kvgate-Pull-From names the source. A client's own pull header never
// reaches a sidecar.
func TestPullsThroughTheSidecar(t *testing.T) {
	fl := startSims(t, 2)
	scs, urls := startSidecars(t, fl)
	cfg := gatewayConfig(fl, "round_robin")
	for i := range cfg.Replicas {
		cfg.Replicas[i].URL = urls[i]
	}
	cfg.KVPulls.Enabled = true
	r := startRig(t, cfg, fl, standin.Config{MessageTimeout: time.Minute})
	body := chat("You answer from the manual. "+strings.Repeat("The manual says caches keep prefixes. ", 80),
		"What does the manual say?", false, 4)
	send := func() (string, string, int, int) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, r.front.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Kv-Cache-Source-Host-Port", "10.9.9.9:7777") // a client's: stripped
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct {
			Usage struct {
				Prompt  int `json:"prompt_tokens"`
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &out) != nil {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		u := out.Usage
		return resp.Header.Get("X-Kvgate-Replica"), resp.Header.Get("X-Kvgate-Pull-From"), u.Details.Cached, u.Prompt
	}
	first, from, _, _ := send()
	if from != "" {
		t.Fatalf("the first request pulled from %q", from)
	}
	// The prompt's full blocks are pulled; its last partial block is computed.
	second, from, cached, prompt := send()
	if second == first || from != first || cached < prompt-32 {
		t.Fatalf("the second request on %s (the first on %s) pulled from %q, %d of %d tokens cached",
			second, first, from, cached, prompt)
	}
	for i, s := range scs {
		want := []string{""}
		if urls[i] == second {
			want = []string{strings.TrimPrefix(first, "http://")}
		}
		s.mu.Lock()
		seen := s.seen
		s.mu.Unlock()
		if strings.Join(seen, ",") != strings.Join(want, ",") {
			t.Errorf("sidecar %s saw pull sources %q, want %q", urls[i], seen, want)
		}
	}
}
