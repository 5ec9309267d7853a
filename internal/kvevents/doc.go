// Package kvevents is vLLM's KV-cache event wire format: the events, the
// msgpack encoding of a batch of them, the three frames of a published
// message, and the conventions for topics and data-parallel ports. It does
// no I/O, so the router follows batches whatever carried them: the ZMQ
// transport is the subpackage kvzmq, and the replay's batches come from the
// engine model through enginekv.
//
// # Messages
//
// A vLLM engine publishes on one ZMQ PUB socket (--kv-events-config
// endpoint, default tcp://*:5557) and sends every batch as a three-frame
// message (EncodeFrames, DecodeFrames)
//
//	[topic, seq, payload]
//
// where topic is the configured topic (vLLM's default is ""), seq is the
// batch's sequence number as 8 bytes big-endian, counting 0, 1, 2, ... per
// publisher (it restarts when the publisher restarts; llm-d's vLLM
// simulator counts from 1), and payload is one msgpack-encoded batch. A
// subscriber that sees seq != last+1 has lost batches (ZMQ PUB drops when a
// subscriber is slow or disconnected, and while nobody is connected) and
// must resynchronise its view of that publisher. llm-d names the topic
// kv@HOST:PORT@MODEL (TopicHost, TopicModel).
//
// # Data parallelism
//
// A vLLM server with data-parallel size N runs N engines, each with its own
// KV cache and publisher: rank k publishes on the configured endpoint's
// port + k (tcp://*:5557 gives 5557, 5558, ...; in the connected topology
// each rank dials port + k of the consumer), its replay socket likewise on
// the replay endpoint's port + k, and its batches carry
// data_parallel_rank k (OffsetPort).
//
// # Payload
//
// The batch is vLLM's EventBatch, a msgspec Struct with array_like=True, so
// it is a positional msgpack array
//
//	[ts float64, events array, data_parallel_rank int|nil]
//
// omit_defaults=True lets msgspec drop the trailing data_parallel_rank when
// it is None, so [ts, events] is valid too (vLLM before the DP rank existed).
//
// Every event is a msgspec tagged Struct (tag=True: the tag is the class
// name). Until vLLM PR #42892 the event structs were array_like too:
//
//	["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...]
//	["BlockRemoved", block_hashes, medium, ...]
//	["AllBlocksCleared"]
//
// The field order is vLLM's declaration order; lora_id, medium and lora_name
// are nullable but have no default, so msgspec always writes them; fields
// added later (extra_keys, group_idx, kv_cache_spec_kind, ...) have defaults
// and are omitted when unset. The oldest vLLM releases stop after lora_id
// (BlockStored) and after block_hashes (BlockRemoved). Since PR #42892
// (vLLM > 0.23) the events are maps keyed by field name with the tag under
// "type", written first:
//
//	{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
//	 "block_size": 16, "lora_id": nil, "medium": "GPU", "lora_name": nil}
//
// while the outer batch stays a positional array. FormMap (the default)
// writes the current map form, FormArray the older positional form; Decode
// reads both, even mixed in one batch, and also a batch encoded as a map
// {"ts", "events", "data_parallel_rank"} in case the envelope follows.
//
// # Block hashes
//
// vLLM's ExternalBlockHash is int | bytes: a 64-bit integer (negative in the
// releases that used Python's hash()), or, by default in recent releases,
// the raw digest bytes (e.g. 32 bytes of sha256). Decode maps both to uint64:
// an integer by its two's-complement bits, bytes as the big-endian value of
// their last 8 bytes (zero-extended when shorter). That is exactly vLLM's own
// maybe_convert_block_hash (int.from_bytes(h, "big") & (2**64-1)), used when
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is set, so a replica reports the same
// uint64 whichever of the two settings it runs with.
//
// # Decoding policy
//
// Decode is strict about what it understands and lenient about what it does
// not: a known field of the wrong type or out of range is an error
// (*DecodeError wrapping ErrMalformed or ErrSchema, with a msgspec-style path
// such as $[1][0].token_ids[3]); unknown fields and unknown event types are
// skipped, so a newer vLLM that adds either still decodes. The payload is
// checked for well-formedness (bounded nesting, lengths that fit the bytes
// left) before any allocation, so hostile input can neither panic nor make
// Decode allocate more than a small multiple of its size.
package kvevents
