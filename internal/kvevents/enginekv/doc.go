// Package enginekv turns the KV events of kvgate's engine model into vLLM's
// KV events (package kvevents). It is the one bridge between the engine
// model and the wire format, kept apart from both so that the router, which
// reads the wire format, never depends on the engine model: `kvgate sim`
// publishes what Events returns, and the replay's router follows it.
package enginekv
