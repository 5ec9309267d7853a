package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// optResponse keeps the HTTP response of an openai-go call (its headers).
func optResponse(r **http.Response) option.RequestOption { return option.WithResponseInto(r) }

// Every path the replicas serve goes through, with its method, query and
// body bytes; the gateway's own paths keep priority.
func TestPassthroughPaths(t *testing.T) {
	a := newAPIReplica(t, "a", "m", "")
	gw := apiGateway(t, a)
	cases := []struct{ method, path, body string }{
		{"POST", "/v1/embeddings", `{"model":"m","input":"hello  world",  "encoding_format":"float"}`},
		{"POST", "/tokenize", `{"model":"m","prompt":"hello"}`},
		{"POST", "/detokenize", `{"model":"m","tokens":[1,2]}`},
		{"POST", "/v1/rerank", `{"model":"m","query":"q","documents":["a","b"]}`},
		{"POST", "/rerank", `{"model":"m","query":"q","documents":["a"]}`},
		{"POST", "/v2/rerank", `{"model":"m","query":"q","documents":["a"]}`},
		{"POST", "/v1/score", `{"model":"m","text_1":"a","text_2":"b"}`},
		{"POST", "/score", `{"model":"m","text_1":"a","text_2":"b"}`},
		{"POST", "/pooling", `{"model":"m","input":"x"}`},
		{"POST", "/classify", `{"model":"m","input":"x"}`},
		{"POST", "/v1/audio/translations?verbose=1", `{"model":"m","x":1.000}`},
		{"POST", "/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`},
		{"POST", "/invocations", `{"model":"m","input":"x"}`},
	}
	for _, c := range cases {
		status, h, body := do(t, c.method, gw.srv.URL+c.path, "application/json", c.body)
		if status != 200 || h.Get("X-Kvgate-Replica") != a.srv.URL {
			t.Fatalf("%s %s: %d %q (replica %q)", c.method, c.path, status, body, h.Get("X-Kvgate-Replica"))
		}
		path, _, _ := strings.Cut(c.path, "?")
		if got := a.requests(); got[len(got)-1] != c.method+" "+path {
			t.Fatalf("%s %s: the replica saw %q", c.method, c.path, got[len(got)-1])
		}
		if c.body != "" && a.body(path) != c.body {
			t.Fatalf("%s: the replica got %q, not the client's bytes", c.path, a.body(path))
		}
	}
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"PUT", "/v1/embeddings", 405},     // not a method the gateway forwards
		{"POST", "/debug/route", 404},      // admin endpoints without a token do not exist
		{"POST", "/admin/replicas", 404},   //
		{"POST", "/not/an/api/path", 404},  // outside the allow-list
		{"GET", "/v1/some/thing", 404},     // any other /v1/ path too
		{"GET", "/v1/completions", 405},    // completions keeps its handler
		{"POST", "/v1/models", 405},        // the gateway's own listing
		{"POST", "/v1/embeddings", 404},    // model not served (body below)
		{"POST", "/v1/responses/x/y", 404}, // only a response's own paths
	} {
		body := `{"model":"m","input":"x"}`
		if c.status == 404 && c.path == "/v1/embeddings" {
			body = `{"model":"nope","input":"x"}`
		}
		if status, _, b := do(t, c.method, gw.srv.URL+c.path, "application/json", body); status != c.status {
			t.Fatalf("%s %s: %d %s, want %d", c.method, c.path, status, b, c.status)
		}
	}
	if status, _, body := do(t, "GET", gw.srv.URL+"/metrics", "", ""); status != 200 || !strings.Contains(body, "kvgate_") {
		t.Fatalf("/metrics is not the gateway's: %d", status)
	}
	if status, _, body := do(t, "POST", gw.srv.URL+"/v1/embeddings", "application/json", `{"model":"m","input":{"a":1}}`); status != 400 ||
		!strings.Contains(body, `"param":"input"`) {
		t.Fatalf("a malformed input: %d %s", status, body)
	}
	waitIdle(t, gw)
}

// A prompt is routed cache-aware: the same input goes back to the replica
// that computed it; different inputs spread.
func TestPassthroughEmbeddingsCacheAware(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	gw := apiGateway(t, a, b)
	c := client(gw.srv.URL)
	ctx := context.Background()
	first := map[int]string{}
	for round := range 2 {
		for k := range 6 {
			input := fmt.Sprintf("document %d: %s", k, strings.Repeat("a long passage to embed. ", 40))
			var resp *http.Response
			_, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "m",
				Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{input, "second"}}},
				optResponse(&resp))
			if err != nil {
				t.Fatal(err)
			}
			got := resp.Header.Get("X-Kvgate-Replica")
			waitIdle(t, gw) // the load of the request answered is off its replica: only the cache decides
			if round == 0 {
				first[k] = got
			} else if got != first[k] {
				t.Fatalf("input %d went to %s, then to %s: not cache-aware", k, first[k], got)
			}
		}
	}
	if len(a.requests()) == 0 || len(b.requests()) == 0 {
		t.Fatalf("six different inputs all went to one replica: a %d, b %d", len(a.requests()), len(b.requests()))
	}
	waitIdle(t, gw)
}

// Without a prompt a request goes by load: while one score request is held
// by a replica, the next one goes to the other.
func TestPassthroughByLoadWithoutPrompt(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan string, 2)
	var reps []*apiReplica
	for _, name := range []string{"a", "b"} {
		f := newAPIReplica(t, name, "m", "")
		inner := f.srv.Config.Handler
		f.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/score" {
				entered <- name
				<-release
			}
			inner.ServeHTTP(w, r)
		})
		reps = append(reps, f)
	}
	gw := apiGateway(t, reps...)
	done := make(chan int, 2)
	for range 2 {
		go func() {
			req, _ := http.NewRequest("POST", gw.srv.URL+"/score", strings.NewReader(`{"model":"m","text_1":"a","text_2":"b"}`))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				done <- 0
				return
			}
			resp.Body.Close()
			done <- resp.StatusCode
		}()
		<-entered // the first is held before the second is sent
	}
	close(release)
	for range 2 {
		if s := <-done; s != 200 {
			t.Fatalf("status %d", s)
		}
	}
	if len(reps[0].requests()) != 1 || len(reps[1].requests()) != 1 {
		t.Fatalf("the second request did not go to the idle replica: a %d, b %d", len(reps[0].requests()), len(reps[1].requests()))
	}
	waitIdle(t, gw)
}

// A body naming a model goes only to the replicas serving it.
func TestPassthroughRoutesByModel(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m-a", ""), newAPIReplica(t, "b", "m-b", "")
	gw := apiGateway(t, a, b)
	for range 6 {
		status, h, body := do(t, "POST", gw.srv.URL+"/v1/score", "application/json", `{"model":"m-b","text_1":"a","text_2":"b"}`)
		if status != 200 || h.Get("X-Kvgate-Replica") != b.srv.URL {
			t.Fatalf("%d %s from %s", status, body, h.Get("X-Kvgate-Replica"))
		}
	}
	if status, _, body := do(t, "POST", gw.srv.URL+"/v1/score", "application/json", `{"model":"zzz"}`); status != 404 ||
		!strings.Contains(body, "model_not_found") {
		t.Fatalf("unknown model: %d %s", status, body)
	}
	if status, _, _ := do(t, "POST", gw.srv.URL+"/detokenize", "application/json", `{"tokens":[1]}`); status != 200 {
		t.Fatalf("a body without a model goes to any replica: %d", status)
	}
	waitIdle(t, gw)
}

// A refusal before any work is retried on another replica; a replica's
// 4xx is the client's answer and counts against no replica.
func TestPassthroughRetryAndClientErrors(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	gw := apiGateway(t, a, b)
	a.status.Store(400)
	b.status.Store(400)
	for range 4 {
		if status, _, _ := do(t, "POST", gw.srv.URL+"/v1/embeddings", "application/json", `{"model":"m","input":"x"}`); status != 400 {
			t.Fatalf("status %d", status)
		}
	}
	noEjections(t, gw)
	a.status.Store(503)
	b.status.Store(0)
	for k := range 4 {
		status, h, _ := do(t, "POST", gw.srv.URL+"/v1/embeddings", "application/json", fmt.Sprintf(`{"model":"m","input":"x%d"}`, k))
		if status != 200 || h.Get("X-Kvgate-Replica") != b.srv.URL {
			t.Fatalf("status %d from %s", status, h.Get("X-Kvgate-Replica"))
		}
	}
	waitIdle(t, gw)
}

// The Responses API's state lives on the replica that created it: a
// follow-up, a GET, a DELETE go there; an id the gateway does not know is
// looked up replica by replica; an id no replica holds is a 404 that
// counts against none.
func TestResponsesStateful(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	gw := apiGateway(t, a, b)
	c := client(gw.srv.URL)
	ctx := context.Background()
	var hr *http.Response
	r1, err := c.Responses.New(ctx, responses.ResponseNewParams{Model: "m", Instructions: openai.String("Be brief."),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("hello")}}, optResponse(&hr))
	if err != nil {
		t.Fatal(err)
	}
	home := hr.Header.Get("X-Kvgate-Replica")
	prev := r1.ID
	for k := range 5 {
		r, err := c.Responses.New(ctx, responses.ResponseNewParams{Model: "m", PreviousResponseID: openai.String(prev),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(fmt.Sprintf("turn %d", k))}}, optResponse(&hr))
		if err != nil {
			t.Fatalf("turn %d: %v", k, err)
		}
		if got := hr.Header.Get("X-Kvgate-Replica"); got != home {
			t.Fatalf("turn %d went to %s, the response is on %s", k, got, home)
		}
		prev = r.ID
	}
	// Streamed: the id comes in response.created; the stream has no [DONE].
	st := c.Responses.NewStreaming(ctx, responses.ResponseNewParams{Model: "m", PreviousResponseID: openai.String(prev),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("stream")}})
	var streamed string
	for st.Next() {
		if ev := st.Current(); ev.Type == "response.completed" {
			streamed = ev.Response.ID
		}
	}
	if err := st.Err(); err != nil || streamed == "" {
		t.Fatalf("stream: %v, id %q", err, streamed)
	}
	got, err := c.Responses.Get(ctx, streamed, responses.ResponseGetParams{}, optResponse(&hr))
	if err != nil || got.ID != streamed || hr.Header.Get("X-Kvgate-Replica") != home {
		t.Fatalf("GET %s: %v from %s", streamed, err, hr.Header.Get("X-Kvgate-Replica"))
	}
	if n := metricValue(t, gw, "kvgate_attempts_total", "verdict", "failed"); n != 0 {
		t.Fatalf("%v attempts counted failed (a Responses stream ends without [DONE])", n)
	}
	// Another gateway has never seen the ids: it looks them up.
	gw2 := apiGateway(t, a, b)
	status, h, body := do(t, "GET", gw2.srv.URL+"/v1/responses/"+r1.ID, "", "")
	if status != 200 || h.Get("X-Kvgate-Replica") != home || !strings.Contains(body, r1.ID) {
		t.Fatalf("lookup: %d %s from %s", status, body, h.Get("X-Kvgate-Replica"))
	}
	before := len(a.requests()) + len(b.requests())
	status, h, _ = do(t, "POST", gw2.srv.URL+"/v1/responses", "application/json",
		fmt.Sprintf(`{"model":"m","input":"again","previous_response_id":%q}`, r1.ID))
	if status != 200 || h.Get("X-Kvgate-Replica") != home || len(a.requests())+len(b.requests()) != before+1 {
		t.Fatalf("after the lookup the holder is known: %d from %s, %d requests", status, h.Get("X-Kvgate-Replica"),
			len(a.requests())+len(b.requests())-before)
	}
	// Deleted: no replica holds it; the last 404 is the answer, counted against none.
	if status, _, _ := do(t, "DELETE", gw.srv.URL+"/v1/responses/"+r1.ID, "", ""); status != 200 {
		t.Fatalf("DELETE: %d", status)
	}
	status, h, body = do(t, "GET", gw.srv.URL+"/v1/responses/"+r1.ID, "", "")
	if status != 404 || !strings.Contains(body, "not found") || h.Get("Retry-After") != "" {
		t.Fatalf("a deleted response: %d %s", status, body)
	}
	for _, f := range []*apiReplica{a, b} { // the lookup asked each replica once
		if n := strings.Count(strings.Join(f.requests(), "\n"), "GET /v1/responses/"+r1.ID); n < 1 {
			t.Fatalf("replica %s was not asked for the deleted response", f.name)
		}
	}
	status, _, _ = do(t, "POST", gw.srv.URL+"/v1/responses", "application/json", `{"model":"m","input":"x","previous_response_id":"resp_none"}`)
	if status != 404 {
		t.Fatalf("an unknown previous_response_id: %d", status)
	}
	noEjections(t, gw)
	waitIdle(t, gw)
	waitIdle(t, gw2)
}

// A multipart upload is streamed to the replica whole (past the part the
// gateway reads), routed by the model field it finds in its first bytes,
// and bounded by max_body_bytes, which is the client's fault.
func TestPassthroughUpload(t *testing.T) {
	a, b := newAPIReplica(t, "a", "whisper", ""), newAPIReplica(t, "b", "m", "")
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	cfg.EjectAfter, cfg.MaxBodyBytes = 1, 1<<20
	gw := startGateway(t, cfg)
	eventually(t, "both listed", func() bool { return gw.g.rt.Replica(0).Served() != nil && gw.g.rt.Replica(1).Served() != nil })
	audio := bytes.Repeat([]byte("RIFF-audio-"), 30000) // 330 kB: past the gateway's peek
	form := func(fileFirst bool, data []byte) (string, *bytes.Buffer) {
		var buf bytes.Buffer
		mw := multipart.NewWriter(&buf)
		file := func() { fw, _ := mw.CreateFormFile("file", "a.wav"); _, _ = fw.Write(data) }
		if fileFirst {
			file()
		}
		_ = mw.WriteField("model", "whisper")
		_ = mw.WriteField("language", "en")
		if !fileFirst {
			file()
		}
		_ = mw.Close()
		return mw.FormDataContentType(), &buf
	}
	for range 4 { // fields first, as Python's client writes them: routed by model
		ct, body := form(false, audio)
		status, h, resp := do(t, "POST", gw.srv.URL+"/v1/audio/transcriptions", ct, body.String())
		if status != 200 || h.Get("X-Kvgate-Replica") != a.srv.URL || !strings.Contains(resp, fmt.Sprintf("%d bytes", len(audio))) {
			t.Fatalf("%d %s from %s", status, resp, h.Get("X-Kvgate-Replica"))
		}
	}
	// Unknown length (chunked) and over max_body_bytes: cut while streaming.
	ct, body := form(false, bytes.Repeat([]byte("x"), 2<<20))
	req, _ := http.NewRequest("POST", gw.srv.URL+"/v1/audio/transcriptions", io.MultiReader(body))
	req.Header.Set("Content-Type", ct)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 413 {
		t.Fatalf("an upload over max_body_bytes: %d %s", resp.StatusCode, msg)
	}
	noEjections(t, gw)
	waitIdle(t, gw)
}

// openai-go writes the file before the model (it sorts the form's
// fields): the model is past the peek, and the upload goes to any replica
// by load, whole.
func TestPassthroughUploadOpenAIClient(t *testing.T) {
	a, b := newAPIReplica(t, "a", "whisper-1", ""), newAPIReplica(t, "b", "whisper-1", "")
	gw := apiGateway(t, a, b)
	c := client(gw.srv.URL)
	audio := bytes.Repeat([]byte("0123456789"), 20000)
	tr, err := c.Audio.Transcriptions.New(context.Background(), openai.AudioTranscriptionNewParams{
		Model: openai.AudioModelWhisper1, File: openai.File(bytes.NewReader(audio), "a.wav", "audio/wav")})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tr.Text, fmt.Sprintf("%d bytes", len(audio))) {
		t.Fatalf("%q", tr.Text)
	}
	waitIdle(t, gw)
}

// /v1/models keeps the fields the replicas list, as they sent them.
func TestModelsKeepReplicaFields(t *testing.T) {
	a := newAPIReplica(t, "a", "m", "")
	gw := apiGateway(t, a)
	status, _, body := do(t, "GET", gw.srv.URL+"/v1/models", "", "")
	for _, want := range []string{`"max_model_len":4096`, `"root":"/models/m"`, `"parent":null`, `"owned_by":"vllm"`,
		`"permission":[{"id":"modelperm-1"`, `"created":1700000000`} {
		if status != 200 || !strings.Contains(body, want) {
			t.Fatalf("%d: %s lacks %s", status, body, want)
		}
	}
}

// metricValue sums a counter's series whose label has the value.
func metricValue(t *testing.T, gw *testGW, name, label, value string) float64 {
	t.Helper()
	fams, err := gw.g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

// On a prefill/decode fleet a Responses call goes whole to a replica that
// decodes, never to a prefill replica; other paths may go to either.
func TestResponsesOnPrefillDecodeFleet(t *testing.T) {
	pre, dec := newAPIReplica(t, "pre", "m", ""), newAPIReplica(t, "dec", "m", "")
	cfg := baseConfig()
	cfg.Replicas = []ReplicaConfig{{URL: pre.srv.URL, Role: "prefill"}, {URL: dec.srv.URL, Role: "decode"}}
	gw := startGateway(t, cfg)
	eventually(t, "both listed", func() bool { return gw.g.rt.Replica(0).Served() != nil && gw.g.rt.Replica(1).Served() != nil })
	for k := range 6 {
		body := fmt.Sprintf(`{"model":"m","input":"question %d %s"}`, k, strings.Repeat("context ", 50))
		if k%2 == 1 {
			body = `{"model":"m"}` // no prompt: by load, among the decoding replicas still
		}
		status, h, resp := do(t, "POST", gw.srv.URL+"/v1/responses", "application/json", body)
		if status != 200 || h.Get("X-Kvgate-Replica") != dec.srv.URL {
			t.Fatalf("%d %s from %s", status, resp, h.Get("X-Kvgate-Replica"))
		}
	}
	if got := pre.requests(); len(got) != 0 {
		t.Fatalf("the prefill replica got %v", got)
	}
	waitIdle(t, gw)
}
