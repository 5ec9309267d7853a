package gateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/router"
)

// The pools' scaling signal (router.Saturation): kvgate_pool_saturation,
// the load each pool is routed over the capacity the TTFT model predicts
// at ttft_objective, with its two parts. Above 1 the pool needs more
// replicas to meet the objective; an autoscaler (KEDA's Prometheus
// scaler) scales on it with a target of 1, or a little under.

// saturationCollector computes the gauges at each scrape.
type saturationCollector struct {
	s                   *router.Saturation
	sat, load, capacity *prometheus.Desc
}

func newSaturationCollector(rt *router.Router, cfg Config, prof costmodel.Profile) *saturationCollector {
	pool := []string{"pool"}
	return &saturationCollector{
		s: router.NewSaturation(rt, router.SaturationConfig{Profile: prof, BatchTokens: cfg.MaxBatchTokens,
			Objective: cfg.TTFTObjective.D(), Window: cfg.SaturationWindow.D()}),
		sat: prometheus.NewDesc("kvgate_pool_saturation", "A pool's load over the capacity its replicas in rotation have "+
			"at the TTFT objective (ttft_objective), by the cost model and an M/M/1 queue per replica: above 1, the pool "+
			"needs more replicas to keep its p90 TTFT within the objective; proportional to the replicas needed.", pool, nil),
		load: prometheus.NewDesc("kvgate_pool_load", "The engine time per second a pool's requests take, in replicas' "+
			"worth, by the cost model (uncached prompt and output tokens), weighted over saturation_window.", pool, nil),
		capacity: prometheus.NewDesc("kvgate_pool_capacity", "The replicas' worth of work a pool's replicas in rotation "+
			"can take within the TTFT objective.", pool, nil),
	}
}

func (c *saturationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.sat
	ch <- c.load
	ch <- c.capacity
}

func (c *saturationCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.s.Sample() {
		name := p.Pool
		if name == "" {
			name = "default"
		}
		ch <- prometheus.MustNewConstMetric(c.sat, prometheus.GaugeValue, p.Saturation, name)
		ch <- prometheus.MustNewConstMetric(c.load, prometheus.GaugeValue, p.Load, name)
		ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, p.Capacity, name)
	}
}
