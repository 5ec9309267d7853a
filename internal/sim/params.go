package sim

import (
	"encoding/json"
	"math"

	"github.com/kvgate/kvgate/internal/prompt"
)

// maxLogprobs is vLLM's default --max-logprobs.
const maxLogprobs = 20

// params are the request fields the sim reads besides the model and the
// prompt, checked as vLLM checks them (a 400 naming the field): integers
// are integers and in range, booleans booleans.
type params struct {
	stream, ignoreEOS, includeUsage bool
	n                               int      // in [1, maxN]
	maxTokens                       intField // ≥ 1 when set; may be saturated
	maxField                        string   // the field maxTokens came from
	minTokens                       int64    // ≥ 0; may be saturated
	seed                            int64
	priority                        int // vLLM's priority (lower is earlier); may be saturated
}

func readParams(kind prompt.Kind, b body) (params, error) {
	x := params{n: 1}
	var err error
	if x.stream, err = b.flag("stream"); err != nil {
		return x, err
	}
	if x.ignoreEOS, err = b.flag("ignore_eos"); err != nil {
		return x, err
	}
	if err := x.readStreamOptions(b); err != nil {
		return x, err
	}
	if err := x.readCounts(b); err != nil {
		return x, err
	}
	if err := x.readMaxTokens(kind, b); err != nil {
		return x, err
	}
	p, err := b.integer("priority")
	if err != nil {
		return x, err
	}
	x.priority = clampInt(p.v)
	return x, checkLogprobs(kind, b)
}

func (x *params) readStreamOptions(b body) error {
	raw := b.get("stream_options")
	if raw == nil {
		return nil
	}
	if !x.stream {
		return badRequest("stream_options", "Stream options can only be defined when `stream=True`.")
	}
	var so body
	if json.Unmarshal(raw, &so) != nil || so == nil {
		return badRequest("stream_options", "stream_options must be an object.")
	}
	var err error
	if x.includeUsage, err = so.flag("include_usage"); err != nil {
		return badRequest("stream_options.include_usage", "include_usage must be a boolean.")
	}
	return nil
}

// readCounts reads n, min_tokens and seed.
func (x *params) readCounts(b body) error {
	n, err := b.integer("n")
	switch {
	case err != nil:
		return err
	case n.set && n.v < 1:
		return badRequest("n", "n must be at least 1, got %d.", n.v)
	case n.set && n.v > maxN:
		return badRequest("n", "n must be at most %d here, got %d.", maxN, n.v)
	case n.set:
		x.n = int(n.v)
	}
	minTokens, err := b.integer("min_tokens")
	switch {
	case err != nil:
		return err
	case minTokens.v < 0:
		return badRequest("min_tokens", "min_tokens must be greater than or equal to 0, got %d.", minTokens.v)
	}
	x.minTokens = minTokens.v
	seed, err := b.integer("seed")
	switch {
	case err != nil:
		return err
	case seed.saturated:
		return badRequest("seed", "seed must be within [%d, %d].", int64(math.MinInt64), int64(math.MaxInt64))
	}
	x.seed = seed.v
	return nil
}

// readMaxTokens reads max_tokens and max_completion_tokens; chat takes the
// latter first (OpenAI's newer name, as vLLM does), completions the former.
func (x *params) readMaxTokens(kind prompt.Kind, b body) error {
	fields := [2]string{"max_tokens", "max_completion_tokens"}
	if kind == prompt.Chat {
		fields[0], fields[1] = fields[1], fields[0]
	}
	for _, name := range fields {
		v, err := b.integer(name)
		switch {
		case err != nil:
			return err
		case v.set && v.v < 1:
			return badRequest(name, "%s must be at least 1, got %d.", name, v.v)
		case v.set && !x.maxTokens.set:
			x.maxTokens, x.maxField = v, name
		}
	}
	return nil
}

// checkLogprobs checks the logprob fields, which the sim accepts and
// answers with logprobs null: completions' logprobs and both kinds'
// prompt_logprobs are counts up to maxLogprobs; chat's logprobs is a
// boolean with top_logprobs the count, which needs logprobs true.
func checkLogprobs(kind prompt.Kind, b body) error {
	count := func(key string) (intField, error) {
		v, err := b.integer(key)
		if err == nil && v.set && (v.v < 0 || v.v > maxLogprobs) {
			err = badRequest(key, "%s must be between 0 and %d, got %d.", key, maxLogprobs, v.v)
		}
		return v, err
	}
	if _, err := count("prompt_logprobs"); err != nil {
		return err
	}
	if kind == prompt.Completion {
		_, err := count("logprobs")
		return err
	}
	on, err := b.flag("logprobs")
	if err != nil {
		return err
	}
	top, err := count("top_logprobs")
	if err == nil && top.v > 0 && !on {
		err = badRequest("top_logprobs", "top_logprobs needs logprobs set to true.")
	}
	return err
}
