package kubernetes

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/testutil"
)

// End to end through the registry: a gateway configured with
// discovery.kubernetes gets this plugin's source (the client made for the
// namespace from the kubeconfig, here client-go's fake), routes to the
// ready endpoint of the selected slice, and has no replica left once the
// slice is deleted.
func TestGatewayRoutesToDiscoveredReplicas(t *testing.T) {
	up, port := upstream(t)
	watching := make(chan struct{}, 1)
	client := typedFakeWatched(t, watching, slice("vllm-a", int32(port), true, "127.0.0.1"))
	asked := make(chan [2]string, 1)
	saved := newClient
	newClient = func(kubeconfig, namespace string) (Client, error) {
		asked <- [2]string{kubeconfig, namespace}
		return client, nil
	}
	defer func() { newClient = saved }()
	cfg := gateway.Defaults()
	cfg.Discovery = &gateway.DiscoveryConfig{Kubernetes: &gateway.KubernetesConfig{Namespace: "llm",
		Selector: "kubernetes.io/service-name=vllm", Port: "http", Kubeconfig: "/etc/kvgate/kubeconfig"}}
	g, err := gateway.New(cfg, gateway.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if a := <-asked; a != [2]string{"/etc/kvgate/kubeconfig", "llm"} {
		t.Fatalf("client made for %q", a)
	}
	send := serveGateway(t, g)
	testutil.Eventually(t, 10*time.Second, "a request routed to the discovered replica", func() bool {
		r := send()
		return r.Status == http.StatusOK && r.Header.Get("X-Kvgate-Replica") == up.URL
	})
	select { // the fake loses a change made before the watch (typedFakeWatched)
	case <-watching:
	case <-time.After(2 * time.Minute):
		t.Fatal("the source never watched the slices")
	}
	slices := client.(interface {
		Delete(context.Context, string, metav1.DeleteOptions) error
	})
	if err := slices.Delete(context.Background(), "vllm-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "no replica once the slice is deleted", func() bool {
		return send().Status == http.StatusServiceUnavailable
	})
}

// upstream is a replica answering completions, and its port.
func upstream(t *testing.T) (*httptest.Server, int) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
		case "/v1/completions":
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
		}
	}))
	t.Cleanup(up.Close)
	_, p, _ := net.SplitHostPort(up.Listener.Addr().String())
	port, _ := strconv.Atoi(p)
	return up, port
}

// serveGateway runs g until the test ends; send posts a completion to it.
func serveGateway(t *testing.T, g *gateway.Gateway) (send func() testutil.Response) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(func() { srv.Close(); cancel(); <-done })
	return func() testutil.Response {
		return testutil.Post(t, nil, srv.URL+"/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`)
	}
}

// End to end through the registry: a gateway configured with
// discovery.kubernetes.inference_pool routes to the pool's Ready pod on
// the pool's port, and has no replica left once the pod is unready.
func TestGatewayRoutesToPoolPods(t *testing.T) {
	up, port := upstream(t)
	f := newPoolFakes(t, []runtime.Object{pool("vllm-pool", vllm(), int64(port))}, pod("vllm-0", "vllm", "127.0.0.1", true))
	saved := newPoolClients
	newPoolClients = func(_, namespace, group string) (PoolClient, PodClient, error) {
		return f.pools.Resource(poolResource(group)).Namespace(namespace), f.pods.Pods(namespace), nil
	}
	defer func() { newPoolClients = saved }()
	cfg := gateway.Defaults()
	cfg.Discovery = &gateway.DiscoveryConfig{Kubernetes: &gateway.KubernetesConfig{Namespace: "llm", InferencePool: "vllm-pool"}}
	g, err := gateway.New(cfg, gateway.Options{})
	if err != nil {
		t.Fatal(err)
	}
	send := serveGateway(t, g)
	testutil.Eventually(t, 10*time.Second, "a request routed to the pool's pod", func() bool {
		r := send()
		return r.Status == http.StatusOK && r.Header.Get("X-Kvgate-Replica") == up.URL
	})
	waitFor(t, f.podWatched, "watch of the pods") // the fake loses a change made before the watch
	if _, err := f.pods.Pods("llm").Update(context.Background(), pod("vllm-0", "vllm", "127.0.0.1", false), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "no replica once the pod is unready", func() bool {
		return send().Status == http.StatusServiceUnavailable
	})
}
