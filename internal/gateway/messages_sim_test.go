package gateway

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/sim"
)

// Claude-Code-style traffic through the gateway to kvgate sim: a
// conversation's turns on /v1/messages, streamed and not, are answered
// (the sim serves the Messages API), and the gateway reads the usage
// from both shapes: every prompt token counted, the later turns' cached
// prefix too, and each stream's first token.
func TestMessagesThroughSim(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 1})
	gw := startGateway(t, simConfig("ttft", fl.URLs()...))
	waitHealthy(t, gw)
	history := `{"role":"user","content":[{"type":"text","text":"` + strings.Repeat("fix the failing test in the parser ", 30) + `"}]}`
	for turn := range 4 {
		stream := turn%2 == 1
		body := fmt.Sprintf(`{"model":%q,"max_tokens":4,"stream":%v,"system":"You are Claude Code.","messages":[%s]}`,
			sim.DefaultModel, stream, history)
		resp, out := post(t, gw.srv.URL+"/v1/messages", body)
		if resp.StatusCode != 200 || stream != strings.Contains(out, "event: message_stop") {
			t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, out)
		}
		history += fmt.Sprintf(`,{"role":"assistant","content":[{"type":"text","text":"step %d"}]},{"role":"user","content":"and then %d"}`, turn, turn)
	}
	waitIdle(t, gw)
	rep := map[string]string{"replica": fl.URLs()[0]}
	if p, c := counterValue(t, gw.g.reg, "kvgate_replica_prompt_tokens_total", rep),
		counterValue(t, gw.g.reg, "kvgate_replica_cached_tokens_total", rep); p < 4*150 || c < 3*100 {
		t.Errorf("prompt tokens %v, cached %v: want every turn's prompt and the later turns' shared prefix", p, c)
	}
	if n := histogramCount(t, gw, "kvgate_time_to_first_token_seconds"); n < 2 {
		t.Errorf("%d first tokens observed, want the 2 streams'", n)
	}
}
