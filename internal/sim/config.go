package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
)

// ErrInvalidConfig wraps every configuration error of Start.
var ErrInvalidConfig = errors.New("sim: invalid config")

// Defaults of Config.
const (
	DefaultModel = "sim-llama-8b"
	// DefaultMaxModelLen caps the context length when the KV cache is larger
	// (Llama-3.1's 128k context).
	DefaultMaxModelLen = 131072
	// DefaultOutputMedian is the median of the output length drawn when a
	// request does not set ignore_eos: chat answers of a few paragraphs.
	DefaultOutputMedian = 128
	// DefaultOutputSigma is the log-space spread of that length.
	DefaultOutputSigma = 0.6
	// DefaultCompletionMaxTokens is OpenAI's legacy completions default.
	DefaultCompletionMaxTokens = 16
	// DefaultChatMaxTokens is the sim's chat default. vLLM's is "whatever
	// fits the context", which would make an unbounded request generate
	// tens of thousands of tokens; 256 keeps a forgotten max_tokens cheap.
	DefaultChatMaxTokens = 256
	// DefaultMaxLag is the default Config.MaxLag: a few timer granules.
	DefaultMaxLag = 5 * time.Millisecond
	// MaxElastic bounds Config.Elastic: the error it allows in a request's
	// engine time should stay below a step's.
	MaxElastic = time.Second
	// MaxTimeScale bounds --time-scale so that virtual nanoseconds,
	// (wall − start) × scale, fit an int64 for more than a day of wall time.
	MaxTimeScale = 1e5
)

// Config describes a fleet of simulated replicas. The zero value of every
// field but Replicas takes a default.
// Scheduling policies (Config.SchedulingPolicy), vLLM's names.
const (
	SchedulingFCFS     = "fcfs"
	SchedulingPriority = "priority"
)

type Config struct {
	Replicas int
	// Host is the listening address of every replica, default 127.0.0.1.
	Host string
	// Port: replica i listens on Port+i; 0 gives every replica an ephemeral port.
	Port int

	// KVEvents turns on the ZMQ KV-event publishers, one per data-parallel
	// rank as in vLLM, each with its own sequence numbers (from
	// KVEventsFirstSeq) and its batches carrying its data_parallel_rank
	// when DataParallelSize > 1. Every batch is published under topic
	// kv@HOST:PORT@MODEL: HOST:PORT the replica's HTTP address, MODEL its
	// Model (vLLM's --model, the base model; not a served name), the
	// convention llm-d's deployments follow.
	//
	// By default each publisher binds: rank k of replica i on
	// tcp://Host:(KVEventsPort + i×N + k), N = DataParallelSize, so that
	// each replica's ranks sit on consecutive ports (vLLM's port + rank)
	// and N = 1 gives KVEventsPort+i. With KVEventsPort 0 each replica
	// takes N consecutive ephemeral ports instead (Replica.KVEndpoints).
	KVEvents     bool
	KVEventsPort int
	// KVEventsConnect, tcp://HOST:PORT, makes the publishers connect
	// instead of binding (vLLM when its endpoint names a host; llm-d's
	// topology, where the router binds one SUB socket): rank k of every
	// replica dials kvevents.OffsetPort(KVEventsConnect, k), and the topic
	// tells the replicas apart. HOST may not be a wildcard (*, 0.0.0.0,
	// ::). Requires KVEvents; excludes KVEventsPort.
	KVEventsConnect string
	// KVEventsReplay binds vLLM's replay socket (replay_endpoint, a ZMQ
	// ROUTER) beside every rank's publisher, buffering its latest 10,000
	// batches (vLLM's buffer_steps): rank k of replica i on
	// tcp://Host:(KVEventsReplayPort + i×N + k), or, with
	// KVEventsReplayPort 0, on N consecutive ephemeral ports
	// (Replica.KVReplayEndpoints). Requires KVEvents; KVEventsReplayPort
	// is ignored without KVEventsReplay, as KVEventsPort is without
	// KVEvents.
	KVEventsReplay     bool
	KVEventsReplayPort int
	// KVEventsFirstSeq is the sequence number of every publisher's first
	// batch: vLLM counts from 0 (the default), llm-d's vLLM simulator
	// from 1.
	KVEventsFirstSeq uint64
	KVEventsForm     kvevents.Form // FormMap (default) or FormArray

	// Model is the model the replicas run (vLLM's --model, a path or a
	// hub name), default DefaultModel; it is also the name requests use
	// unless ServedModelNames is set.
	Model string
	// ServedModelNames are vLLM's --served-model-name: the names requests
	// use for the base model instead of Model. /v1/models lists each with
	// root = Model; the first names the model in metrics (model_name) and
	// as the LoRA adapters' parent (KV-event topics name Model, as vLLM's
	// --model). Default [Model].
	ServedModelNames []string
	// Adapters are LoRA adapter names served beside the model: a request
	// naming one is accepted, its blocks are partitioned by it, its KV
	// events carry it as lora_name, and vllm:lora_requests_info reports it.
	Adapters []string
	Profile  string // costmodel profile name, default costmodel.Default

	// PerReplica[i] changes what replica i serves, for a heterogeneous
	// fleet; replicas beyond its length serve the fleet's.
	PerReplica []ReplicaOverride

	// Role is every replica's part in prefill/decode disaggregation
	// (default engine.RoleBoth): a prefill replica serves requests whose
	// kv_transfer_params ask for a remote decode, a decode replica those
	// that ask for a remote prefill, a "both" replica either; every role
	// serves plain requests too (see kvtransfer.go). Roles[i], when set,
	// is replica i's role instead; replicas beyond its length take Role.
	Role  engine.Role
	Roles []engine.Role
	// KVHoldTimeout is how long a prefill replica holds a request's blocks
	// for its decode replica, in virtual time (vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT); default engine.DefaultKVHoldTimeout.
	KVHoldTimeout time.Duration
	// OffloadBlocks is each core's host (CPU) tier in blocks, vLLM's
	// OffloadingConnector (engine.Config.HostBlocks); 0: none.
	OffloadBlocks int
	// Logger gets the sim's warnings (a failed KV pull or release); nil
	// discards them.
	Logger *slog.Logger

	// DataParallelSize is vLLM's --data-parallel-size: the engine cores
	// (data-parallel ranks) of each replica, default 1. Each core has its
	// own KV cache of KVBlocks, scheduler and step loop on the same
	// profile; a request's X-Data-Parallel-Rank header picks one, and
	// without it the replica takes the least loaded. Metrics carry one
	// series per core (label engine), KV-event batches their core's
	// data_parallel_rank. At most MaxDataParallelSize.
	DataParallelSize int

	KVBlocks       int // KV cache blocks per replica (per core), default engine.DefaultNumBlocks
	BlockSize      int // tokens per block, default engine.DefaultBlockSize
	MaxBatchTokens int // default engine.DefaultMaxBatchTokens
	MaxSeqs        int // default engine.DefaultMaxSeqs
	// SchedulingPolicy is vLLM's --scheduling-policy: "fcfs" (the
	// default) or "priority" (the waiting queue by each request's
	// priority field, lower first; engine.Config.PriorityScheduling).
	// Under fcfs a request naming a priority other than 0 is refused, as
	// vLLM refuses it.
	SchedulingPolicy string
	// MaxModelLen is the longest prompt + max_tokens accepted, default
	// min(DefaultMaxModelLen, KVBlocks × BlockSize); it may not exceed what
	// the cache holds (vLLM refuses to start then).
	MaxModelLen int
	Jitter      float64 // relative step-time noise, see engine.Config.Jitter

	Seed uint64
	// TimeScale > 1 runs faster than real time: virtual time = wall time
	// elapsed × TimeScale. Default 1; at most MaxTimeScale.
	TimeScale float64

	OutputMedian int     // median output length without ignore_eos, default DefaultOutputMedian
	OutputSigma  float64 // log-space standard deviation of that length, default DefaultOutputSigma

	Faults Faults
	// FaultReplicas lists the replica indexes the faults apply to; nil or
	// empty means every replica.
	FaultReplicas []int

	// MaxLag is how far (wall time) a busy driver's virtual time may trail
	// the wall clock before it jumps forward; see core.drive. Default
	// DefaultMaxLag.
	MaxLag time.Duration

	// Elastic > 0 makes the fleet's model time elastic (see Timeline): it
	// never runs more than Elastic (model time) ahead of a busy engine
	// core, waiting for one that falls behind instead of leaving it behind,
	// so that a host too slow for TimeScale slows the run down instead of
	// distorting it. It also bounds how far before its arrival a request
	// may join a step (MaxLag does not apply). 0: the wall clock paces
	// model time, as kvgate sim serves. At most MaxElastic.
	Elastic time.Duration

	// Clock is the wall clock of the drivers and faults; default
	// clock.Real(). The engine never reads one: the driver converts wall
	// time to virtual time and passes it in, so tests drive a replica with a
	// clock.Fake.
	Clock clock.Clock
}

// ReplicaOverride is what one replica serves when it differs from its
// siblings. Zero fields keep the fleet's, except that a Model without
// ServedModelNames is served under its own name.
type ReplicaOverride struct {
	Model            string
	ServedModelNames []string
	// Adapters: nil keeps the fleet's; an empty non-nil slice serves none.
	Adapters []string
}

// Faults injects failures for reliability testing. Every draw comes from a
// generator seeded by Config.Seed and the replica index.
type Faults struct {
	// ErrorRate is the probability that an inference request is answered
	// 500 with an OpenAI error body.
	ErrorRate float64
	// FailAfter > 0: every inference request after the FailAfter-th gets 503,
	// and /health turns 503 too (vLLM's dead-engine behaviour).
	FailAfter int
	// StallRate is the probability that a request is held Stall (wall time)
	// before its first byte.
	StallRate float64
	Stall     time.Duration
	// DieRate is the probability that a request's connection is cut: after
	// the first chunk of a streamed response, before any byte of a
	// non-streamed one.
	DieRate float64
	// RefuseAfter > 0 and RefuseFor > 0: RefuseAfter after start the
	// replica closes its listener and every open connection (so new
	// connections are refused), and RefuseFor later listens again on the
	// same port. The engine and its cache survive.
	RefuseAfter, RefuseFor time.Duration
	// CrashOn, when not empty, is a query of death: an inference request
	// whose prompt (a completions prompt, or the text of the chat messages
	// as rendered) contains it crashes the replica, which closes its
	// listener and every open connection at once (as a refuse window
	// does: the crashing request gets no answer) and listens again CrashFor
	// later. The engine and its cache survive, as with RefuseAfter.
	CrashOn  string
	CrashFor time.Duration
}

func (f Faults) any() bool {
	return f.ErrorRate > 0 || f.FailAfter > 0 || f.StallRate > 0 || f.DieRate > 0 ||
		(f.RefuseAfter > 0 && f.RefuseFor > 0) || f.CrashOn != ""
}

// withDefaults fills the zero fields.
func (c Config) withDefaults() Config {
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if len(c.ServedModelNames) == 0 {
		c.ServedModelNames = []string{c.Model}
	}
	if c.Profile == "" {
		c.Profile = costmodel.Default
	}
	if c.DataParallelSize == 0 {
		c.DataParallelSize = 1
	}
	if c.KVBlocks == 0 {
		c.KVBlocks = engine.DefaultNumBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = engine.DefaultBlockSize
	}
	if c.MaxBatchTokens == 0 {
		c.MaxBatchTokens = engine.DefaultMaxBatchTokens
	}
	if c.MaxSeqs == 0 {
		c.MaxSeqs = engine.DefaultMaxSeqs
	}
	if c.SchedulingPolicy == "" {
		c.SchedulingPolicy = SchedulingFCFS
	}
	if c.MaxModelLen == 0 && c.KVBlocks > 0 && c.BlockSize > 0 {
		c.MaxModelLen = int(min(int64(DefaultMaxModelLen), int64(c.KVBlocks)*int64(c.BlockSize)))
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.OutputMedian == 0 {
		c.OutputMedian = DefaultOutputMedian
	}
	if c.OutputSigma == 0 {
		c.OutputSigma = DefaultOutputSigma
	}
	if c.MaxLag == 0 {
		c.MaxLag = DefaultMaxLag
	}
	if c.KVHoldTimeout == 0 {
		c.KVHoldTimeout = engine.DefaultKVHoldTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Clock = clock.OrReal(c.Clock)
	return c
}

func (c Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.Replicas < 1:
		return bad("replicas %d < 1", c.Replicas)
	case c.Port < 0 || c.Port+c.Replicas-1 > 65535:
		return bad("ports %d..%d out of range", c.Port, c.Port+c.Replicas-1)
	case c.KVEventsForm != kvevents.FormMap && c.KVEventsForm != kvevents.FormArray:
		return bad("kv-event form %v", c.KVEventsForm)
	case c.SchedulingPolicy != SchedulingFCFS && c.SchedulingPolicy != SchedulingPriority:
		return bad("scheduling policy %q: want %s or %s", c.SchedulingPolicy, SchedulingFCFS, SchedulingPriority)
	case !(c.TimeScale > 0 && c.TimeScale <= MaxTimeScale):
		return bad("time scale %v out of (0, %g]", c.TimeScale, float64(MaxTimeScale))
	case c.MaxLag < 0:
		return bad("max lag %v < 0", c.MaxLag)
	case c.Elastic < 0 || c.Elastic > MaxElastic:
		return bad("elastic slack %v out of [0, %v]", c.Elastic, MaxElastic)
	case c.DataParallelSize < 1 || c.DataParallelSize > MaxDataParallelSize:
		return bad("data parallel size %d out of [1, %d]", c.DataParallelSize, MaxDataParallelSize)
	case c.KVBlocks < 1 || c.BlockSize < 1:
		return bad("kv blocks %d and block size %d must be ≥ 1", c.KVBlocks, c.BlockSize)
	case c.MaxModelLen < 1:
		return bad("max model len %d < 1", c.MaxModelLen)
	case int64(c.MaxModelLen) > int64(c.KVBlocks)*int64(c.BlockSize):
		// vLLM: "The model's max seq len is larger than the maximum number of
		// tokens that can be stored in KV cache".
		return bad("max model len %d exceeds the KV cache (%d blocks × %d tokens)", c.MaxModelLen, c.KVBlocks, c.BlockSize)
	case c.OutputMedian < 1 || !(c.OutputSigma >= 0 && c.OutputSigma <= 5):
		return bad("output median %d must be ≥ 1 and sigma %v in [0, 5]", c.OutputMedian, c.OutputSigma)
	case len(c.PerReplica) > c.Replicas:
		return bad("%d per-replica overrides for %d replicas", len(c.PerReplica), c.Replicas)
	case len(c.Roles) > c.Replicas:
		return bad("%d per-replica roles for %d replicas", len(c.Roles), c.Replicas)
	case c.KVHoldTimeout < 0:
		return bad("kv hold timeout %v < 0", c.KVHoldTimeout)
	case c.OffloadBlocks < 0 || c.OffloadBlocks >= math.MaxInt32:
		return bad("offload blocks %d out of [0, %d)", c.OffloadBlocks, math.MaxInt32)
	}
	for _, role := range append([]engine.Role{c.Role}, c.Roles...) {
		if role > engine.RoleDecode {
			return bad("role %v", role)
		}
	}
	if err := c.validateKVEvents(); err != nil {
		return bad("%v", err)
	}
	for i := range c.Replicas {
		if err := c.forReplica(i).validateNames(); err != nil {
			return bad("replica %d: %v", i, err)
		}
	}
	if err := c.Faults.validate(); err != nil {
		return bad("%v", err)
	}
	for _, i := range c.FaultReplicas {
		if i < 0 || i >= c.Replicas {
			return bad("fault replica %d out of [0, %d)", i, c.Replicas)
		}
	}
	return nil
}

// validateKVEvents checks the KV-event sockets: every rank's port in range
// (rank k of replica i on base + i×N + k) and no two ranges of fixed ports
// overlapping, the connect endpoint a tcp://HOST:PORT with a host to dial.
// DataParallelSize is valid.
func (c Config) validateKVEvents() error {
	if !c.KVEvents {
		switch {
		case c.KVEventsConnect != "":
			return errors.New("kv-event connect endpoint without KV events")
		case c.KVEventsReplay:
			return errors.New("kv-event replay sockets without KV events")
		}
		return nil
	}
	type portRange struct {
		name        string
		first, size int
	}
	n := c.Replicas * c.DataParallelSize // sockets of each kind
	ranges := []portRange{{"HTTP", c.Port, c.Replicas}}
	if c.KVEventsConnect != "" {
		if c.KVEventsPort != 0 {
			return fmt.Errorf("kv-event port %d and connect endpoint %q exclude each other", c.KVEventsPort, c.KVEventsConnect)
		}
		if err := validateConnect(c.KVEventsConnect, c.DataParallelSize); err != nil {
			return err
		}
	} else {
		ranges = append(ranges, portRange{"kv-event", c.KVEventsPort, n})
	}
	if c.KVEventsReplay {
		ranges = append(ranges, portRange{"kv-event replay", c.KVEventsReplayPort, n})
	}
	for i, a := range ranges {
		if a.first < 0 || a.first+a.size-1 > 65535 {
			return fmt.Errorf("%s ports %d..%d out of range (%d replicas × %d ranks)", a.name, a.first, a.first+a.size-1,
				c.Replicas, c.DataParallelSize)
		}
		for _, b := range ranges[:i] {
			if a.first > 0 && b.first > 0 && a.first < b.first+b.size && b.first < a.first+a.size {
				return fmt.Errorf("%s ports %d..%d overlap the %s ports %d..%d", a.name, a.first, a.first+a.size-1,
					b.name, b.first, b.first+b.size-1)
			}
		}
	}
	return nil
}

// validateConnect checks a connect endpoint: tcp://HOST:PORT, HOST an
// address to dial (not a wildcard), and PORT + rank a port for every rank.
func validateConnect(ep string, ranks int) error {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	host, port, err := net.SplitHostPort(rest)
	if !ok || err != nil {
		return fmt.Errorf("kv-event connect endpoint %q: want tcp://HOST:PORT", ep)
	}
	if ip := net.ParseIP(host); host == "" || host == "*" || (ip != nil && ip.IsUnspecified()) {
		return fmt.Errorf("kv-event connect endpoint %q: host %q is a wildcard; name the host to connect to", ep, host)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p+ranks-1 > 65535 {
		return fmt.Errorf("kv-event connect endpoint %q: ports %s..+%d out of range", ep, port, ranks-1)
	}
	return nil
}

// validate checks the faults' rates and durations.
func (f Faults) validate() error {
	for _, p := range []struct {
		name string
		v    float64
	}{{"error rate", f.ErrorRate}, {"stall rate", f.StallRate}, {"die rate", f.DieRate}} {
		if !(p.v >= 0 && p.v <= 1) || math.IsNaN(p.v) {
			return fmt.Errorf("fault %s %v out of [0, 1]", p.name, p.v)
		}
	}
	switch {
	case f.FailAfter < 0:
		return fmt.Errorf("fault fail-after %d < 0", f.FailAfter)
	case f.Stall < 0 || f.RefuseAfter < 0 || f.RefuseFor < 0 || f.CrashFor < 0:
		return errors.New("fault durations must be ≥ 0")
	case (f.CrashOn != "") != (f.CrashFor > 0):
		return errors.New("fault crash-on and crash-for go together")
	case f.StallRate > 0 && f.Stall == 0:
		return fmt.Errorf("fault stall rate %v without a stall duration", f.StallRate)
	case (f.RefuseAfter > 0) != (f.RefuseFor > 0):
		return errors.New("fault refuse-after and refuse-for go together")
	}
	return nil
}

// forReplica is the configuration replica i runs with: the fleet's with
// its override applied.
func (c Config) forReplica(i int) Config {
	if i < len(c.Roles) {
		c.Role = c.Roles[i]
	}
	if i >= len(c.PerReplica) {
		return c
	}
	o := c.PerReplica[i]
	if o.Model != "" {
		c.Model, c.ServedModelNames = o.Model, []string{o.Model}
	}
	if len(o.ServedModelNames) > 0 {
		c.ServedModelNames = o.ServedModelNames
	}
	if o.Adapters != nil {
		c.Adapters = o.Adapters
	}
	return c
}

// validateNames checks that every name a replica serves is non-empty and
// names one thing.
func (c Config) validateNames() error {
	seen := map[string]bool{}
	for _, n := range slices.Concat(c.ServedModelNames, c.Adapters) {
		if n == "" || seen[n] {
			return fmt.Errorf("served model and adapter names must be non-empty and distinct, got %q",
				slices.Concat(c.ServedModelNames, c.Adapters))
		}
		seen[n] = true
	}
	return nil
}

// servedName is the model's first served name: the one in metrics, topics
// and adapter cards.
func (c Config) servedName() string { return c.ServedModelNames[0] }

// faultsFor returns the faults replica i runs with.
func (c Config) faultsFor(i int) Faults {
	if len(c.FaultReplicas) == 0 || slices.Contains(c.FaultReplicas, i) {
		return c.Faults
	}
	return Faults{}
}
