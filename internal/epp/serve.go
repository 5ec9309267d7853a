package epp

import (
	"context"
	"errors"
	"net"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
)

// Health services, as the endpoint-picker protocol names them: liveness
// (the process answers), readiness (it can pick: the gateway's /ready),
// and the ext_proc service itself (as readiness); "" is readiness too,
// for probes that name no service.
const (
	ServiceLiveness  = "liveness"
	ServiceReadiness = "readiness"
)

var readinessServices = []string{"", ServiceReadiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName}

// readyEvery is how often readiness is recomputed (wall time: a probe's
// answer, not a routing decision).
const readyEvery = 500 * time.Millisecond

// Gateway is what Serve needs of the gateway: its readiness and its drain.
type Gateway interface {
	Ready() error
	StartDrain()
}

// Register registers the ext_proc service on gs.
func (s *Server) Register(gs *grpc.Server) { extprocv3.RegisterExternalProcessorServer(gs, s) }

// Serve serves the ext_proc service and gRPC health checking on ln until
// ctx ends; then readiness turns NOT_SERVING and the gateway drains: the
// streams in flight get drainTimeout to end, then are cut.
func (s *Server) Serve(ctx context.Context, ln net.Listener, g Gateway, drainTimeout time.Duration) error {
	hs := health.NewServer()
	hs.SetServingStatus(ServiceLiveness, healthpb.HealthCheckResponse_SERVING)
	srv := grpc.NewServer(
		// A buffered body comes whole in one message: room for
		// max_body_bytes and its header.
		grpc.MaxRecvMsgSize(int(s.maxBody)+(1<<20)),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
	)
	s.Register(srv)
	healthpb.RegisterHealthServer(srv, hs)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	tick := time.NewTicker(readyEvery)
	defer tick.Stop()
	for {
		setReadiness(hs, g.Ready() == nil)
		select {
		case err := <-errc:
			return err
		case <-ctx.Done():
			return drain(srv, hs, g, errc, drainTimeout)
		case <-tick.C:
		}
	}
}

func setReadiness(hs *health.Server, ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range readinessServices {
		hs.SetServingStatus(svc, st)
	}
}

// drain stops taking streams and lets those in flight end, for at most d.
func drain(srv *grpc.Server, hs *health.Server, g Gateway, errc <-chan error, d time.Duration) error {
	g.StartDrain()
	setReadiness(hs, false)
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		srv.Stop() // the streams still open are cut: their requests end as the client's going
		<-done
	}
	hs.Shutdown()
	if err := <-errc; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}
