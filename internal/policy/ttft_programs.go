package policy

import (
	"fmt"
	"math"
)

// Programs in the ttft policy (issue 27). A program's next turn finds its
// context on its home replica (Request.Program). Sending it elsewhere
// costs more than the turn's own TTFT there, which the estimate already
// weighs (the context is prefilled again): the replica that takes the
// program computes the whole context again, work every request queued
// behind it there waits for; and the program's later turns live there from
// then on, so where the live programs homed there already fill its KV
// cache, each of those turns evicts a paused program's context or has its
// own evicted, and prefills it again. So, for a continuing program, every
// replica but its home is charged
//
//	move(r) = program_weight × reprefill(r) × (1 + future × overflow(r))
//
// where reprefill(r) is the time to prefill on r the part of the context
// the home holds and r does not (the cost model, as for the request's own
// prefill), future the program's expected turns to come, and overflow(r)
// the share of its context that does not fit r's KV beside the contexts
// the live programs homed on r reserve (ReplicaView.ProgramTokens): 0
// where it fits, 1 where r is already full. A program whose home is
// saturated still moves: when the home's queue costs more than the move.
//
// future is the program's turns so far, at most program_future_turns: for
// the heavy-tailed turn counts of agents (AgentX: median 43, a long tail),
// a program that has lasted t turns has about t more to come (the Lindy
// estimate of a power-law lifetime).
//
// A replica that holds none of the request also holds none of the opening
// its program shares with others (a chat's system prompt): moved there,
// the program keeps a copy of it in r's KV while each of its turns runs,
// where on the home the programs of its family hold one copy between
// them. Where KV bounds the fleet's throughput (as many tokens as its
// caches hold already wait or run), that copy is a running request fewer:
//
//	hold(r) = fleetKV × future × overflow(r) × lost(r)/capacity(r) × decode(r)
//
// the share of r's KV the copy takes for the turn's decode (its output
// tokens at r's step time), which the requests waiting there lose, once
// per turn to come; fleetKV is the fleet's KV demand in flight over its
// capacity (at most 1), overflow(r) as above (where r's KV keeps every
// program's context, nothing waits for it). A replica holding part of
// the request holds the opening: the blocks it lacks are the program's
// own history, which takes as much KV on the home as there. Unweighted
// (program_weight discounts the re-prefill, which the estimate prices
// already; this cost it prices nowhere else). Multiturn chats on 4
// replicas of 1,000 blocks, 4 system prompts, 24/s (#25): ttft moved 84
// chats off their homes once every replica was saturated, spreading
// each system prompt over 2–4 replicas, and ran 11 % fewer requests at a
// time than SGLang's router, which never moves one (p90 TTFT 656 ms
// against 474); with the price, 487 ms.
//
// With the parameter programs (default true) the policy also asks the
// router to place programs (policy.PlacesPrograms: KV admission of new
// programs, bursts of identical prompts); programs=false turns both off,
// the ablation.
//
// Bursts: the router sends a burst's followers (the n samples of an RL
// rollout's prompt) after its first request (ReplicaView.BurstPending).
// They hit the prompt and decode from the step after its prefill, so the
// estimate counts them among r's decodes while they wait for their first
// token, where a request waiting for its prefill is not counted (a queued
// request may not decode for long: counting every one made ttft lose to
// llm-d's rule live under cache pressure). A rollout batch arrives at
// once, every request pending; counting only decodes already running, the
// decode term saw none and the batch's prompts were spread by prefill
// tokens alone: up to 5 prompts × 8 samples on a replica and 3 on another,
// the batch ending with the longest answer on the busier one. Counted, the
// replicas take as many samples (rl workload, 8 replicas, 8 batches of 32
// prompts × 8: batch makespan p50 over seeds 1–40, ttft wins over preble
// on 30, 12 before; mean difference −36 ms, +28.5 ms before).

// programPrice is what the Pick of one request knows of its program.
type programPrice struct {
	home      int // position of the home in the views; -1: no move to price
	homeMatch int // blocks of the request the home holds
	future    float64
	fleetKV   float64 // the healthy replicas' KV footprint over their capacity, in [0, 1] (hold)
}

// programPrice reads req's program: a continuing program whose home is a
// candidate (else nothing to price).
func (t *TTFT) programPrice(req *Request, rs []ReplicaView) programPrice {
	pp := programPrice{home: -1}
	p := req.Program
	if !t.params.Programs || t.params.ProgramWeight == 0 || !p.Continues {
		return pp
	}
	var footprint, capacity float64
	for i := range rs {
		if !rs[i].Healthy {
			continue
		}
		if rs[i].Index == p.Home {
			pp.home, pp.homeMatch = i, min(count(rs[i].Match), len(req.Blocks))
		}
		f, c := t.kvFootprint(&rs[i])
		footprint, capacity = footprint+f, capacity+c
	}
	pp.future = float64(min(count(p.Turns), int(t.params.ProgramFutureTurns)))
	if capacity > 0 {
		pp.fleetKV = min(footprint/capacity, 1)
	}
	return pp
}

// moveMs is move(r) + hold(r) for the replica at position i, whose load
// is l, for out expected output tokens (ms; 0 for the home and for a
// request without a program to price).
func (t *TTFT) moveMs(pp *programPrice, req *Request, rs []ReplicaView, i int, l *ttftLoad, out float64) float64 {
	if pp.home < 0 || i == pp.home {
		return 0
	}
	v := &rs[i]
	bs := t.o.BlockSize
	lost := max(pp.homeMatch-min(count(v.Match), len(req.Blocks)), 0) * bs
	if lost == 0 {
		return 0
	}
	prof := t.o.Profile
	held := min(count(v.Match), len(req.Blocks)) * bs
	reprefill := prof.C1*float64(lost) + prof.C2*float64(lost)*float64(held+lost) + math.Ceil(float64(lost)/l.chunk)*l.stepMs
	over := t.overflow(req, v)
	move := t.params.ProgramWeight * reprefill * (1 + pp.future*over)
	if held == 0 {
		if _, capacity := t.kvFootprint(v); capacity > 0 {
			move += pp.fleetKV * pp.future * over * float64(lost) / capacity * out * l.stepMs
		}
	}
	return move
}

// overflow is the share of req's program context that does not fit v's
// KV cache beside the live programs homed there: in [0, 1].
func (t *TTFT) overflow(req *Request, v *ReplicaView) float64 {
	ctx := float64(max(count(req.Tokens)+count(req.MaxTokens), 1))
	if v.NumBlocks <= 0 {
		return 0
	}
	capacity := float64(count(v.NumBlocks)) * float64(t.o.BlockSize)
	return min(max((float64(count(v.ProgramTokens))+ctx-capacity)/ctx, 0), 1)
}

// moveReason says why a program left its home, for /debug/route and logs.
func moveReason(pp *programPrice, rs []ReplicaView, ttfts, scores []float64, choice int) string {
	home := pp.home
	return fmt.Sprintf("program moved off its home %s: estimated TTFT there %.0f ms (score %.0f), here %.0f ms "+
		"(score %.0f with the move priced in)", rs[home].URL, ttfts[home], scores[home], ttfts[choice], scores[choice])
}

// PlacesPrograms: the router places programs for ttft (KV admission, bursts)
// unless its parameter programs is false.
func (t *TTFT) PlacesPrograms() bool { return t.params.Programs }
