package sim

import (
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// With --cpu-offload-blocks the replica publishes its host tier's events as
// vLLM's OffloadingConnector does (medium CPU, hashes only), in both wire
// forms; a prompt the GPU evicted is loaded from the host tier (its cached
// tokens in the usage, the load in vLLM's offload metrics).
func TestOffloadTierEvents(t *testing.T) {
	for _, form := range []kvevents.Form{kvevents.FormMap, kvevents.FormArray} {
		t.Run(form.String(), func(t *testing.T) {
			cfg := fast()
			cfg.KVEvents, cfg.KVEventsForm = true, form
			cfg.KVBlocks, cfg.OffloadBlocks = 24, 100
			f := startFleet(t, cfg)
			rep := f.Replicas()[0]
			c := testClient(t)
			send := func(text string) completion {
				return decodeCompletion(t, testutil.Post(t, c, rep.URL()+"/v1/completions",
					`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1}`))
			}
			l := subscribeKV(t, rep)
			l.warmUp(t, func(s string) { send(s) })
			root := prompt.RootOf("engine", prompt.Key{Model: "sim-llama-8b"})
			a := words("aaa", 200)
			ha := prompt.ApproxBlockHashes(nil, root, a, 16)
			send(a)
			var cpu []uint64
			for !slices.Contains(cpu, ha[len(ha)-1]) {
				for _, ev := range l.next(t).Batch.Events {
					st, ok := ev.(*kvevents.BlockStored)
					if !ok || st.Medium != "CPU" {
						continue
					}
					if st.ParentBlockHash != nil || len(st.TokenIDs) != 0 || st.BlockSize != 16 {
						t.Fatalf("CPU stored event is not the connector's payload: %+v", st)
					}
					cpu = append(cpu, st.BlockHashes...)
				}
			}
			if !slices.Equal(cpu, ha) {
				t.Fatalf("CPU stored %x, want the prompt's blocks %x", cpu, ha)
			}
			send(words("bbb", 350)) // 22 of the GPU's 24 blocks: A is evicted from it but for a block or two
			if got := send(a).Usage.PromptTokensDetails.CachedTokens; got != 192 {
				t.Fatalf("cached tokens %d, want the 12 blocks loaded from the host tier", got)
			}
			fams := scrape(t, c, rep.URL())
			load, _ := metricValue(fams, MetricOffloadLoadBytes, nil)
			usage, _ := metricValue(fams, MetricOffloadUsage, nil)
			if load < 10*16*131072 || load > 192*131072 || int(load)%(16*131072) != 0 || !(usage > 0.3 && usage < 0.5) {
				t.Fatalf("offload load bytes %v, usage %v", load, usage)
			}
		})
	}
}

// A request with kv_transfer_params.remote_kv_source pulls what the named
// peer holds of its prompt (usage reports it cached; the sim's header says
// pulled); a peer that holds nothing, or is not there, makes it compute the
// prompt without an error. A malformed source is the client's error.
func TestPeerPullOverTheWire(t *testing.T) {
	cfg := fast()
	cfg.Replicas = 2
	f := startFleet(t, cfg)
	src, dst := f.Replicas()[0], f.Replicas()[1]
	c := testClient(t)
	a := words("aaa", 400)
	post := func(url, text, params string) testutil.Response {
		return testutil.Post(t, c, url+"/v1/completions",
			`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1,"kv_transfer_params":`+params+`}`)
	}
	source := func(r *Replica) string {
		host, port, _ := net.SplitHostPort(strings.TrimPrefix(r.URL(), "http://"))
		return `{"remote_kv_source":{"kv_request_id":"x1","remote_host":"` + host + `","remote_port":` + port + `}}`
	}
	decodeCompletion(t, testutil.Post(t, c, src.URL()+"/v1/completions",
		`{"model":"sim-llama-8b","prompt":`+jsonString(a)+`,"max_tokens":1}`))
	r := post(dst.URL(), a, source(src))
	if got := decodeCompletion(t, r).Usage.PromptTokensDetails.CachedTokens; got != 384 {
		t.Fatalf("pulled: cached %d, want 384", got)
	}
	if h := r.Header.Get(HeaderKVPull); h != "pulled" {
		t.Fatalf("header %q", h)
	}
	fams := scrape(t, c, dst.URL())
	if n, _ := metricValue(fams, MetricPeerPullTokens, nil); n != 384 {
		t.Fatalf("pulled tokens %v", n)
	}
	// A peer that holds none of the prompt: computed, no error.
	r = post(dst.URL(), words("ccc", 400), source(src))
	if got := decodeCompletion(t, r).Usage.PromptTokensDetails.CachedTokens; got != 0 ||
		!strings.HasPrefix(r.Header.Get(HeaderKVPull), "recomputed") {
		t.Fatalf("peer without the prompt: cached %d, header %q", got, r.Header.Get(HeaderKVPull))
	}
	// A peer that is not there: computed, no error.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	r = post(dst.URL(), words("ddd", 400),
		`{"remote_kv_source":{"remote_host":"127.0.0.1","remote_port":`+strconv.Itoa(port)+`}}`)
	if decodeCompletion(t, r); !strings.HasPrefix(r.Header.Get(HeaderKVPull), "recomputed") {
		t.Fatalf("gone peer: header %q", r.Header.Get(HeaderKVPull))
	}
	// Both count as missed pulls, the first as pulled.
	fams = scrape(t, c, dst.URL())
	pulled, _ := metricValue(fams, MetricPeerPulls, map[string]string{"result": "pulled"})
	missed, _ := metricValue(fams, MetricPeerPulls, map[string]string{"result": "missed"})
	if pulled != 1 || missed != 2 {
		t.Fatalf("pulls: %v pulled, %v missed; want 1 and 2", pulled, missed)
	}
	for _, bad := range []string{
		`{"remote_kv_source":"127.0.0.1:1"}`,
		`{"remote_kv_source":{"remote_port":1}}`,
		`{"remote_kv_source":{"remote_host":"h","remote_port":0}}`,
		`{"remote_kv_source":{"remote_host":7,"remote_port":1}}`,
		`{"do_remote_prefill":true,"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1,"remote_block_ids":[1],"remote_kv_source":{"remote_host":"h","remote_port":1}}`,
	} {
		if r := post(dst.URL(), a, bad); r.Status != http.StatusBadRequest || !strings.Contains(r.Body, "kv_transfer_params") {
			t.Errorf("%s: status %d %s", bad, r.Status, r.Body)
		}
	}
}
