package kvevents

import (
	"net"
	"strconv"
	"strings"
)

// OffsetPort is the endpoint data-parallel rank k of a vLLM server uses
// when it is configured with endpoint: vLLM gives rank k the port + k (and
// an ipc path the suffix _dpK), for its publisher and its replay socket
// alike. Rank 0, an empty endpoint and one without a port are unchanged.
func OffsetPort(endpoint string, k int) string {
	if endpoint == "" || k == 0 {
		return endpoint
	}
	if path, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		return "ipc://" + path + "_dp" + strconv.Itoa(k)
	}
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return endpoint
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return endpoint
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return endpoint
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+k))
}

// TopicModel is the model of a topic of the form kv@HOST:PORT@MODEL, as
// llm-d configures vLLM's publishers ("" for any other topic, such as
// vLLM's default "").
func TopicModel(topic string) string {
	if i := strings.LastIndexByte(topic, '@'); i >= 0 && strings.Count(topic, "@") >= 2 {
		return topic[i+1:]
	}
	return ""
}

// TopicHost is the HOST:PORT (or HOST) of a topic kv@HOST:PORT@MODEL (""
// for any other topic).
func TopicHost(topic string) string {
	parts := strings.Split(topic, "@")
	if len(parts) < 3 {
		return ""
	}
	return strings.Join(parts[1:len(parts)-1], "@")
}
