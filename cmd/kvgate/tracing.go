package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/internal/gateway"
)

// The OpenTelemetry SDK and its OTLP exporter are set up here, in the
// binary, and handed to the gateway as a TracerProvider: the gateway
// itself uses only the OpenTelemetry API (internal/gateway/tracing.go), so
// that neither its tests nor the request path link the exporter.

// tracingEnabled reports whether tracing is on: `tracing: true` in the
// configuration, or OTEL_TRACES_EXPORTER set (to otlp), unless
// OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. An OTLP endpoint
// variable alone does not turn it on: it is often set for the whole
// host or pod.
func tracingEnabled(cfg gateway.Config, getenv func(string) string) bool {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	exp := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))
	if exp == "none" {
		return false
	}
	return cfg.Tracing || exp != ""
}

// errTracingConfig marks an OTEL_* setting kvgate cannot honour.
var errTracingConfig = errors.New("tracing")

// startTracing builds the tracer provider of `kvgate serve` when tracing
// is on (tracingEnabled; else nil, and a no-op shutdown): spans are
// batched to an OTLP/HTTP exporter configured by the standard variables
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
// default http://localhost:4318; OTEL_EXPORTER_OTLP_HEADERS,
// OTEL_EXPORTER_OTLP_TIMEOUT, OTEL_EXPORTER_OTLP_COMPRESSION …), sampled
// by OTEL_TRACES_SAMPLER (default parentbased_always_on), with the
// resource of OTEL_SERVICE_NAME (default kvgate) and
// OTEL_RESOURCE_ATTRIBUTES. Only the http/protobuf protocol is built in
// (it keeps the binary small): OTEL_EXPORTER_OTLP_PROTOCOL=grpc is
// refused, as is an exporter other than otlp. shutdown flushes the spans
// still batched: call it after the drain.
func startTracing(ctx context.Context, cfg gateway.Config) (trace.TracerProvider, func(context.Context) error, error) {
	noop := func(context.Context) error { return nil }
	if !tracingEnabled(cfg, os.Getenv) {
		return nil, noop, nil
	}
	if exp := strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER")); exp != "" && exp != "otlp" {
		return nil, noop, fmt.Errorf("%w: OTEL_TRACES_EXPORTER=%q: kvgate exports with otlp (or none)", errTracingConfig, exp)
	}
	for _, v := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if p := strings.TrimSpace(os.Getenv(v)); p != "" {
			if p != "http/protobuf" {
				return nil, noop, fmt.Errorf("%w: %s=%q: kvgate's OTLP exporter speaks http/protobuf only", errTracingConfig, v, p)
			}
			break // the traces' own setting wins over the general one
		}
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, noop, fmt.Errorf("%w: the OTLP exporter: %v", errTracingConfig, err)
	}
	res, err := resource.Merge(resource.NewSchemaless(attribute.String("service.name", "kvgate")), resource.Environment())
	if err != nil {
		return nil, noop, fmt.Errorf("%w: OTEL_RESOURCE_ATTRIBUTES: %v", errTracingConfig, err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}

// flushTracing exports the spans still batched, within a bound: a
// collector that is down must not hold the exit.
func flushTracing(stop func(context.Context) error, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := stop(ctx); err != nil {
		log.Warn("tracing: the last spans could not be exported", "err", err)
	}
}
