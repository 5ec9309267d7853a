package gateway

import (
	"errors"
	"fmt"
	"net"
	"time"
)

// EPPConfig is epp: kvgate as the endpoint picker (EPP) of a Gateway API
// inference gateway: an Envoy ext_proc server (internal/epp) speaking the
// Gateway API Inference Extension's endpoint-picker protocol.
type EPPConfig struct {
	// Listen is the gRPC address of the ext_proc service and of gRPC
	// health checking (the Inference Extension's default port is 9002).
	Listen string `json:"listen"`
	// Fallbacks is how many more endpoints each pick lists after the
	// chosen one (the protocol's comma-separated list), which the proxy
	// tries in order when its retry policy allows; 0: the chosen one only.
	Fallbacks int `json:"fallbacks"`
	// BodyMode is the body mode assumed when the proxy does not say
	// (an Envoy before ProcessingRequest.protocol_config):
	// full_duplex_streamed (the protocol's) or buffered.
	BodyMode string `json:"body_mode"`
	// DestinationNamespace and SubsetNamespace are the metadata
	// namespaces of the pick (envoy.lb) and of the proxy's subset hint
	// (envoy.lb.subset_hint), the protocol's defaults.
	DestinationNamespace string `json:"destination_namespace"`
	SubsetNamespace      string `json:"subset_namespace"`
}

// Body modes of epp.body_mode.
const (
	BodyModeFullDuplex = "full_duplex_streamed"
	BodyModeBuffered   = "buffered"
)

// DefaultEPP is epp's defaults.
func DefaultEPP() EPPConfig {
	return EPPConfig{Listen: "127.0.0.1:9002", Fallbacks: 1, BodyMode: BodyModeFullDuplex,
		DestinationNamespace: "envoy.lb", SubsetNamespace: "envoy.lb.subset_hint"}
}

// maxFallbacks bounds epp.fallbacks: the proxy tries them one by one.
const maxFallbacks = 8

// validateEPP checks epp: and the saturation gauge's settings.
func (c *Config) validateEPP() []error {
	var errs []error
	e := c.EPP
	if _, _, err := net.SplitHostPort(e.Listen); err != nil {
		errs = append(errs, fmt.Errorf("epp.listen %q: want HOST:PORT", e.Listen))
	}
	if e.Fallbacks < 0 || e.Fallbacks > maxFallbacks {
		errs = append(errs, fmt.Errorf("epp.fallbacks %d: want 0 to %d", e.Fallbacks, maxFallbacks))
	}
	if e.BodyMode != BodyModeFullDuplex && e.BodyMode != BodyModeBuffered {
		errs = append(errs, fmt.Errorf("epp.body_mode %q: want %s or %s", e.BodyMode, BodyModeFullDuplex, BodyModeBuffered))
	}
	if e.DestinationNamespace == "" || e.SubsetNamespace == "" {
		errs = append(errs, errors.New("epp.destination_namespace and epp.subset_namespace must not be empty"))
	}
	if c.TTFTObjective.D() < time.Millisecond || c.SaturationWindow.D() < time.Second {
		errs = append(errs, errors.New("ttft_objective must be at least 1ms and saturation_window at least 1s"))
	}
	return errs
}
