package ui_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// chromium is the browser's path, or the test skips saying why.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Skip("no chromium on PATH: the live view's browser test needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
	return ""
}

// browser starts a headless chromium for the test, ended (and waited for)
// at cleanup.
func browser(t *testing.T, path string) context.Context {
	t.Helper()
	// No sandbox: chromium refuses it as root, and CI containers often lack
	// the user namespaces it needs otherwise; the browser only loads the
	// test's own page from 127.0.0.1.
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 900), chromedp.Flag("disable-dev-shm-usage", true), chromedp.NoSandbox)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	bound := 40 * time.Second // a bound on a stuck browser, not a timing assertion
	if os.Getenv("KVGATE_SCREENSHOT") == "1" {
		bound = 3 * time.Minute // the screenshot's traffic spans several buckets
	}
	ctx, cancelTimeout := context.WithTimeout(ctx, bound)
	t.Cleanup(func() {
		cancelTimeout()
		_ = chromedp.Cancel(ctx) // closes the browser and waits for it
		cancelCtx()
		cancelAlloc()
	})
	return ctx
}

// The live view in a real browser: it signs in with the token, drops it
// from the address, lists one row per replica, and its numbers move as
// requests go through the gateway. KVGATE_SCREENSHOT=1 writes docs/ui.png.
func TestUIInChromium(t *testing.T) {
	path := chromium(t)
	fl := startSim(t, sim.Config{Replicas: 3, KVEvents: true, KVEventsReplay: true})
	cfg := baseConfig(fl.URLs()...)
	cfg.Policy = "ttft"
	for i, r := range fl.Replicas() { // KV events, replayed from before the gateway subscribed
		cfg.Replicas[i].KVEvents, cfg.Replicas[i].KVEventsReplay = r.KVEndpoint(), r.KVReplayEndpoint()
	}
	cfg.Tokenizer = "remote"
	cfg.AdminToken = "ui-test-token"
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	ctx := browser(t, path)

	if err := chromedp.Do(ctx,
		chromedp.Navigate(gw.srv.URL+"/ui?token="+cfg.AdminToken),
		chromedp.Poll[chromedp.Void](`document.querySelectorAll("#replicas tbody tr").length === 3`, chromedp.WithPollingTimeout(10*time.Second)),
	); err != nil {
		t.Fatalf("the page shows no row per replica: %v", err)
	}
	loc, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(loc, "token") {
		t.Errorf("the token stayed in the address: %s", loc)
	}
	urls, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](
		`Array.from(document.querySelectorAll("#replicas tbody tr")).map(r => r.dataset.url)`))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(urls, " ") != strings.Join(fl.URLs(), " ") {
		t.Errorf("rows %v, want the replicas %v", urls, fl.URLs())
	}
	if before, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID("attempts"))); err != nil || before != "0" {
		t.Fatalf("attempts before any request: %q %v", before, err)
	}

	sendConversations(t, gw.srv.URL, 0, 4, 5)

	// The numbers move: the attempts count, the fleet's hit rate from the
	// replicas' usage, the decisions list and each row's share.
	moved := `Number(document.getElementById("attempts").textContent) === 20 &&
		document.getElementById("hitrate").textContent.endsWith("%") &&
		document.querySelectorAll("#decisions tbody tr").length > 0 &&
		Array.from(document.querySelectorAll("#replicas td.share")).some(td => !td.textContent.startsWith("0.0 %")) &&
		Array.from(document.querySelectorAll("#replicas td.waiting")).every(td => /^\d+( \(\d+ not ours\))?$/.test(td.textContent)) &&
		document.querySelectorAll("#ttft-chart polyline").length > 0`
	if err := chromedp.Do(ctx, chromedp.Poll[chromedp.Void](moved, chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		text, _ := chromedp.Run(ctx, chromedp.Text(chromedp.CSS("body")))
		t.Fatalf("the page's numbers did not move: %v\n%s", err, text)
	}
	if os.Getenv("KVGATE_SCREENSHOT") == "1" {
		screenshot(t, ctx, gw.srv.URL)
	}
}

// screenshot writes docs/ui.png after a few more waves of traffic, one per
// 10-second bucket so that the charts draw a line. Waiting for the next
// bucket is a wait on the wall clock: this runs only on demand
// (KVGATE_SCREENSHOT=1, about a minute), never in CI.
func screenshot(t *testing.T, ctx context.Context, base string) {
	for wave := 1; wave <= 5; wave++ {
		slot := time.Now().UnixNano() / int64(ui.BucketWidth)
		testutil.Eventually(t, 2*ui.BucketWidth, "the next bucket", func() bool {
			return time.Now().UnixNano()/int64(ui.BucketWidth) > slot
		})
		sendConversations(t, base, 10*wave, 2+wave%3, 3+wave%2)
	}
	if err := chromedp.Do(ctx, chromedp.Poll[chromedp.Void](`document.querySelectorAll("#hit-chart polyline").length > 0 &&
		document.getElementById("inflight").textContent === "0"`, chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		t.Fatal(err)
	}
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join("..", "..", "..", "docs", "ui.png")
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s (%d bytes)", out, len(png))
}

// sendConversations runs n chat conversations (numbered from first) of
// turns turns each, side by side, every turn carrying the conversation so
// far (a shared prefix), behind one of two system prompts.
func sendConversations(t *testing.T, base string, first, n, turns int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for c := first; c < first+n; c++ {
		wg.Go(func() {
			system := []string{"You are a careful assistant. ", "You answer in one line. "}[c/10%2]
			msgs := []map[string]string{{"role": "system", "content": strings.Repeat(system, 30)}}
			for turn := range turns {
				msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("conversation %d, question %d: %s", c, turn,
					strings.Repeat("tell me more about prefix caches. ", 8))})
				req := map[string]any{"model": sim.DefaultModel, "messages": msgs, "max_tokens": 8}
				if turn%2 == 0 {
					req["stream"], req["stream_options"] = true, map[string]any{"include_usage": true}
				}
				if err := postOK(base+"/v1/chat/completions", req); err != nil {
					errs <- fmt.Errorf("conversation %d turn %d: %w", c, turn, err)
					return
				}
				msgs = append(msgs, map[string]string{"role": "assistant", "content": "an answer of eight tokens or so"})
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// postOK posts a JSON body and reads the answer, an error unless 200 (for
// goroutines, which may not call t.Fatal).
func postOK(url string, body any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return err
	}
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d %s", resp.StatusCode, out)
	}
	return nil
}
