//go:build !nokubernetes

package main

import (
	"encoding/json"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/epp"
	"github.com/kvgate/kvgate/internal/gateway"
)

// The endpoint picker's Kubernetes objects (deploy/epp), as the Gateway
// API Inference Extension v1 and KEDA read them.
type inferencePool struct {
	Selector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"selector"`
	TargetPorts []struct {
		Number int `json:"number"`
	} `json:"targetPorts"`
	EndpointPickerRef struct {
		Name string `json:"name"`
		Port struct {
			Number int `json:"number"`
		} `json:"port"`
		FailureMode string `json:"failureMode"`
	} `json:"endpointPickerRef"`
}

type httpRoute struct {
	ParentRefs []struct{ Name string } `json:"parentRefs"`
	Rules      []struct {
		BackendRefs []struct{ Group, Kind, Name string } `json:"backendRefs"`
	} `json:"rules"`
}

type scaledObject struct {
	ScaleTargetRef struct{ APIVersion, Kind, Name string } `json:"scaleTargetRef"`
	Triggers       []struct {
		Type       string            `json:"type"`
		MetricType string            `json:"metricType"`
		Metadata   map[string]string `json:"metadata"`
	} `json:"triggers"`
}

// grpcProbe is a probe by gRPC health checking.
type grpcProbe struct {
	GRPC *struct {
		Port    int    `json:"port"`
		Service string `json:"service"`
	} `json:"grpc"`
}

// eppConfig is the configuration `kvgate epp` runs with for args.
func eppConfig(t *testing.T, args ...string) (gateway.Config, error) {
	t.Helper()
	var f eppFlags
	cfg, _, err := f.eppConfig(parsedFlags(t, "epp", f.register, args))
	return cfg, err
}

// The Gateway API example parses and holds together: the InferencePool
// selects the vLLM pods (vllm-example.yaml) on one port, and kvgate
// follows that pool (with the RBAC to read it and its pods); its endpointPickerRef is kvgate's Service, whose
// port reaches the ext_proc port of kvgate epp's configuration (which
// passes --check-config); the HTTPRoute sends to the pool through the
// Gateway; health is gRPC health checking; the ScaledObject scales the
// vLLM pods on kvgate_pool_saturation.
func TestEPPManifests(t *testing.T) {
	objs := append(loadManifestsIn(t, "epp"), loadManifests(t)...)
	poolObj := find(t, objs, "InferencePool", "vllm-pool")
	pool := specOf[inferencePool](t, poolObj)
	vllm := specOf[k8sWorkload](t, find(t, objs, "StatefulSet", "vllm"))
	if !matches(pool.Selector.MatchLabels, vllm.Template.Metadata.Labels) || len(pool.TargetPorts) != 1 {
		t.Fatalf("the pool's selector %v and ports %v: want the vLLM pods' labels %v and one port", pool.Selector.MatchLabels,
			pool.TargetPorts, vllm.Template.Metadata.Labels)
	}
	d := specOf[k8sWorkload](t, find(t, objs, "Deployment", "kvgate-epp"))
	c := container(t, d.Template.Spec, "kvgate")
	if len(c.Command) != 2 || c.Command[1] != "epp" {
		t.Fatalf("command %v: want [BINARY epp]", c.Command)
	}
	cfg := eppDeployedConfig(t, objs, d, c)
	if err := checkConfig(cfg); err != nil {
		t.Fatalf("the picker's configuration fails --check-config: %v", err)
	}
	checkPoolDiscovery(t, objs, poolObj, cfg, d.Template.Spec.ServiceAccountName)
	checkPickerService(t, objs, pool, d, c, cfg)
	route := specOf[httpRoute](t, find(t, objs, "HTTPRoute", "llm"))
	find(t, objs, "Gateway", route.ParentRefs[0].Name)
	if b := route.Rules[0].BackendRefs; len(b) != 1 || b[0] != (struct{ Group, Kind, Name string }{"inference.networking.k8s.io", "InferencePool", "vllm-pool"}) {
		t.Errorf("the HTTPRoute's backend %+v: want the InferencePool", b)
	}
	so := specOf[scaledObject](t, find(t, objs, "ScaledObject", "vllm"))
	if so.ScaleTargetRef.Kind != "StatefulSet" || so.ScaleTargetRef.Name != "vllm" || len(so.Triggers) != 1 {
		t.Fatalf("ScaledObject %+v: want the vllm StatefulSet, one trigger", so)
	}
	tr := so.Triggers[0]
	th, err := strconv.ParseFloat(tr.Metadata["threshold"], 64)
	if tr.Type != "prometheus" || tr.MetricType != "Value" || !strings.Contains(tr.Metadata["query"], "kvgate_pool_saturation") ||
		err != nil || th <= 0 || th > 1 {
		t.Errorf("trigger %+v: want prometheus, metricType Value, a query of kvgate_pool_saturation, a threshold in (0, 1]", tr)
	}
}

// eppDeployedConfig is the configuration the picker's container runs with:
// its --config file, from the ConfigMap mounted there.
func eppDeployedConfig(t *testing.T, objs []k8sObject, d k8sWorkload, c k8sContainer) gateway.Config {
	t.Helper()
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 >= len(c.Args) {
		t.Fatalf("args %v: no --config FILE", c.Args)
	}
	dir, file := path.Split(c.Args[i+1])
	var cm string
	for _, m := range c.VolumeMounts {
		for _, v := range d.Template.Spec.Volumes {
			if path.Clean(m.MountPath) == path.Clean(dir) && v.Name == m.Name && v.ConfigMap != nil {
				cm = v.ConfigMap.Name
			}
		}
	}
	text, ok := find(t, objs, "ConfigMap", cm).Data[file]
	if !ok {
		t.Fatalf("ConfigMap %s has no %s", cm, file)
	}
	args := slices.Clone(c.Args)
	args[i+1] = writeConfig(t, text)
	cfg, err := eppConfig(t, args...)
	if err != nil {
		t.Fatalf("kvgate epp %v: %v", args, err)
	}
	return cfg
}

// checkPoolDiscovery: kvgate follows the InferencePool whose
// endpointPickerRef it serves, in the pool's namespace (--pool-name,
// --pool-namespace), and may read it and its pods.
func checkPoolDiscovery(t *testing.T, objs []k8sObject, pool k8sObject, cfg gateway.Config, sa string) {
	t.Helper()
	k := discoveredIn(cfg)
	if k == nil || k.InferencePool != pool.Metadata.Name || k.Namespace != pool.Metadata.Namespace || k.InferencePoolGroup != "" {
		t.Fatalf("the picker's discovery %+v: want the InferencePool %s/%s (v1)", k, pool.Metadata.Namespace, pool.Metadata.Name)
	}
	checkRBAC(t, objs, sa, pool.Metadata.Namespace, "inference.networking.k8s.io", "inferencepools")
	checkRBAC(t, objs, sa, pool.Metadata.Namespace, "", "pods")
}

// checkPickerService: the pool's endpointPickerRef is a Service whose port
// reaches the container's ext_proc port, epp.listen's, probed by gRPC
// health checking; its metrics port reaches listen's.
func checkPickerService(t *testing.T, objs []k8sObject, pool inferencePool, d k8sWorkload, c k8sContainer, cfg gateway.Config) {
	t.Helper()
	svc := specOf[k8sService](t, find(t, objs, "Service", pool.EndpointPickerRef.Name))
	if !matches(svc.Selector, d.Template.Metadata.Labels) {
		t.Fatalf("Service %s selects %v, not the picker's pods %v", pool.EndpointPickerRef.Name, svc.Selector, d.Template.Metadata.Labels)
	}
	_, grpcPort, _ := strings.Cut(cfg.EPP.Listen, ":")
	_, opsPort, _ := strings.Cut(cfg.Listen, ":")
	ports := map[int]int{}
	for _, p := range svc.Ports {
		ports[p.Port] = containerPort(t, c, p.TargetPort)
	}
	if strconv.Itoa(ports[pool.EndpointPickerRef.Port.Number]) != grpcPort {
		t.Errorf("the pool names port %d of %s, which reaches %d; epp.listen is %s", pool.EndpointPickerRef.Port.Number,
			pool.EndpointPickerRef.Name, ports[pool.EndpointPickerRef.Port.Number], cfg.EPP.Listen)
	}
	if !slices.ContainsFunc(slices.Collect(maps.Values(ports)), func(p int) bool { return strconv.Itoa(p) == opsPort }) {
		t.Errorf("no Service port reaches the ops port %s (metrics)", opsPort)
	}
	var spec struct {
		Template struct {
			Spec struct {
				Containers []struct{ ReadinessProbe, LivenessProbe *grpcProbe } `json:"containers"`
			} `json:"spec"`
		} `json:"template"`
	}
	if err := json.Unmarshal(find(t, objs, "Deployment", "kvgate-epp").Spec, &spec); err != nil {
		t.Fatal(err)
	}
	pr := spec.Template.Spec.Containers[0]
	for name, p := range map[string]*grpcProbe{epp.ServiceReadiness: pr.ReadinessProbe, epp.ServiceLiveness: pr.LivenessProbe} {
		if p == nil || p.GRPC == nil || strconv.Itoa(p.GRPC.Port) != grpcPort || p.GRPC.Service != name {
			t.Errorf("%s probe: want gRPC health checking of service %q on %s", name, name, grpcPort)
		}
	}
}

// The plain-Envoy example is a valid Envoy bootstrap by Envoy's own protos
// (every field known, every typed config resolved, the protos' validation
// rules kept), and speaks the endpoint-picker protocol with kvgate: the
// ext_proc filter calls kvgate's default port over HTTP/2 in the
// protocol's body mode, accepts the envoy.lb metadata kvgate writes, and
// the replicas' cluster picks the host kvgate names and reports the one
// that served.
func TestEnvoyConfig(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot(t), "deploy", "envoy", "envoy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("not an Envoy v3 bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("Envoy's validation: %v", err)
	}
	hcm := &hcmv3.HttpConnectionManager{}
	if err := b.StaticResources.Listeners[0].FilterChains[0].Filters[0].GetTypedConfig().UnmarshalTo(hcm); err != nil {
		t.Fatal(err)
	}
	ep := &extprocfilterv3.ExternalProcessor{}
	if err := hcm.HttpFilters[0].GetTypedConfig().UnmarshalTo(ep); err != nil {
		t.Fatalf("the first HTTP filter is not ext_proc: %v", err)
	}
	pm := ep.GetProcessingMode()
	if pm.GetRequestBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED || pm.GetResponseBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
		pm.GetRequestTrailerMode() != extprocfilterv3.ProcessingMode_SEND || pm.GetResponseTrailerMode() != extprocfilterv3.ProcessingMode_SEND {
		t.Errorf("processing mode %v: want FULL_DUPLEX_STREAMED bodies with trailers sent", pm)
	}
	d := gateway.DefaultEPP()
	if !slices.Contains(ep.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), d.DestinationNamespace) ||
		!slices.Contains(ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped(), d.DestinationNamespace) {
		t.Errorf("metadata options %v: Envoy must accept and forward %s", ep.GetMetadataOptions(), d.DestinationNamespace)
	}
	clusters := map[string]*clusterv3.Cluster{}
	for _, c := range b.StaticResources.Clusters {
		clusters[c.Name] = c
	}
	picker := clusters[ep.GetGrpcService().GetEnvoyGrpc().GetClusterName()]
	_, port, _ := strings.Cut(d.Listen, ":")
	if picker == nil || strconv.Itoa(int(picker.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetSocketAddress().GetPortValue())) != port ||
		picker.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"] == nil {
		t.Errorf("ext_proc's cluster %v: want kvgate's port %s over HTTP/2", picker, port)
	}
	checkOverrideHost(t, clusters[hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()[0].GetRoute().GetCluster()], d)
}

// checkOverrideHost: the route's cluster picks by kvgate's endpoints.
func checkOverrideHost(t *testing.T, c *clusterv3.Cluster, d gateway.EPPConfig) {
	t.Helper()
	oh := &overridehostv3.OverrideHost{}
	if c == nil || c.GetLoadBalancingPolicy().GetPolicies()[0].GetTypedExtensionConfig().GetTypedConfig().UnmarshalTo(oh) != nil {
		t.Fatalf("the route's cluster %v: want the override_host load balancing policy", c)
	}
	var fromMeta, fromHeader bool
	for _, s := range oh.GetOverrideHostSources() {
		fromHeader = fromHeader || s.GetHeader() == epp.HeaderDestination
		fromMeta = fromMeta || s.GetMetadata().GetKey() == d.DestinationNamespace && s.GetMetadata().GetPath()[0].GetKey() == epp.HeaderDestination
	}
	served := oh.GetSelectedHostKey()
	if !fromMeta || !fromHeader || served.GetKey() != d.DestinationNamespace || served.GetPath()[0].GetKey() != epp.KeyServed {
		t.Errorf("override_host %v: want %s from %s metadata and the header, the served host in %s", oh, epp.HeaderDestination,
			d.DestinationNamespace, epp.KeyServed)
	}
}
