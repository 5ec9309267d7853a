package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

// Finding 15: /v1/models keeps the replicas' fields and needs a key when
// keys are configured.
func TestModelsEndpoint(t *testing.T) {
	a := newStub(t, `{"object":"list","data":[{"id":"m","root":"/models/m","parent":null,"max_model_len":4096},`+
		`{"id":"lora","root":"/adapters/l","parent":"m","max_model_len":4096}]}`, okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.APIKeys = []string{"k"}
	gw, _ := gwWithClock(t, cfg)
	get := func(key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, gw.srv.URL+"/v1/models", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(""); code != 401 {
		t.Fatalf("without a key: %d", code)
	}
	code, body := get("k")
	var list struct {
		Data []struct {
			ID          string  `json:"id"`
			Root        string  `json:"root"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if code != 200 || json.Unmarshal([]byte(body), &list) != nil || len(list.Data) != 2 {
		t.Fatalf("%d %s", code, body)
	}
	l := list.Data[0] // sorted by id
	if l.ID != "lora" || l.Root != "/adapters/l" || l.Parent == nil || *l.Parent != "m" || l.MaxModelLen != 4096 ||
		list.Data[1].Parent != nil {
		t.Fatalf("fields lost: %s", body)
	}
}
