// Package kvzmq carries vLLM's KV-event messages (package kvevents) over
// ZMQ: the publisher kvgate sim runs, the subscriber and the bound listener
// the gateway runs, and the replay socket's client and server. It speaks
// ZMTP 3 through github.com/go-zeromq/zmq4 (pure Go), with every frame's
// size checked at its header before zmq4 allocates for it.
//
// # Topologies
//
// The PUB socket is used in either of two topologies, and vLLM picks by
// the endpoint (BindsEndpoint: "bind stable, connect volatile"):
//
//   - bound (a wildcard host such as tcp://*:5557, or ipc://): every
//     subscriber connects to each engine. NewZMQPublisher and NewPublisher
//     bind; Subscribe connects, one subscriber per engine.
//   - connected (any other tcp:// endpoint): every engine connects to one
//     SUB socket bound by the consumer (llm-d's router). NewPublisher with
//     Connect dials, and redials after a failure; Listen binds the SUB
//     socket and accepts any number of publishers. Batches of different
//     engines then share one socket, so sequence numbers must be tracked
//     per publisher: per (topic, data_parallel_rank).
//
// In both the ZMTP roles are ZMQ's: the SUB side sends a subscription
// message (0x01 + topic prefix) after the handshake, whichever side dialed.
//
// # Who may publish on a bound SUB socket
//
// Anyone who reaches a Listen socket can connect and publish under any
// topic, and a topic kv@HOST:PORT@MODEL only claims a replica. The Listener
// bounds what a peer may cost (connections per source address and in all,
// with the longest-idle slot of the busiest address going to a newcomer
// when full; the handshake's time and size; each frame's size, refused at
// its header before anything is allocated; the silence between messages)
// and hands each connection's source address to the caller's checks:
// ListenOptions.AcceptFrom at accept, Authorize per message before
// decoding. Trust and AddrBook are the pieces kvgate builds them from: a
// publisher speaks for the replicas at its own address (an IP, or a name
// resolved in the background), unless a CIDR list or "any" trusts more.
//
// # Replay
//
// An engine may also bind a ZMQ ROUTER socket (replay_endpoint) serving the
// latest batches it published (buffer_steps, 10_000 by default), whether or
// not anyone was subscribed. A client (DEALER or REQ) sends
//
//	["", start_seq]	(start_seq as 8 bytes big-endian)
//
// and gets, for every buffered batch with seq >= start_seq in order,
//
//	["", seq, payload]
//
// and then the end marker ["", END, ""], END being the 8 bytes of -1
// (0xFF...FF). Some vLLM versions put the topic in as well: ["", topic,
// seq, payload] and ["", "", END, ""]. A malformed request gets no answer.
// The socket answers anyone who connects with every buffered batch, token
// ids included: what the engine's cache holds of its users' prompts.
// NewPublisher serves the 3-frame form when given ReplayEndpoint; Replay is
// the client and reads both forms. A subscriber that finds a gap asks the
// replay socket for the missing batches; those older than the buffer are
// gone for good.
//
// Data-parallel rank k of a vLLM server publishes, and serves its replay
// socket, on the configured port + k (kvevents.OffsetPort).
package kvzmq
